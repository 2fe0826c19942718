"""What the proxy does differently by how a consumer receives encoder output: from the store it
shares with the encoders (vLLM's ECExampleConnector, or any connector whose consumer loads by
identifier), or pushed to it over Mooncake (`ECMooncakeConnector`, the consumer named by its
control address). The status page shows each consumer's row; docs/transports.md explains them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from epd_proxy.fleet.backends import PREFILL, PREFILL_DECODE, Instance

STORE, PUSH = "store", "mooncake push"


@dataclass(frozen=True, slots=True)
class Features:
    # Media the consumer or the store already holds are named, not encoded again.
    reuse: bool
    # With every encoder failed or swamped, the consumer takes the media raw and encodes them:
    # a Mooncake consumer never encodes, it waits for a push (`ensure_cache_available`).
    consumer_encodes: bool
    # Which requests' images may share one encoder sub-request.
    coalescing: str
    # What a retried attempt sends the encoders.
    retries: str


FEATURES = {
    STORE: Features(
        reuse=True, consumer_encodes=True, coalescing="any requests", retries="encodes again under the same names"
    ),
    PUSH: Features(
        reuse=False,
        consumer_encodes=False,
        coalescing="requests pushed to the same consumer address",
        retries="fresh transfer ids, away from the encoders whose pushes never landed",
    ),
}


def transport(instance: Instance) -> str | None:
    """How `instance` receives encoder output; None for those that receive none (encoders, and
    decode behind a prefill)."""
    if instance.role not in (PREFILL, PREFILL_DECODE):
        return None
    return PUSH if instance.zmq_addrs else STORE


def view(instance: Instance) -> dict[str, Any] | None:
    """The status page's account of `instance`'s transport and what it gets."""
    name = transport(instance)
    return None if name is None else {"name": name, **asdict(FEATURES[name])}
