"""Backend instances as the proxy sees them (calling them is `upstream`'s job)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from epd_proxy.fleet.prefill_cost import prefill_speed
from epd_proxy.fleet.speed import Speed

# Final: as literals they index routing.Policies, a dict typed per role.
ENCODE: Final = "encode"
PREFILL: Final = "prefill"
DECODE: Final = "decode"
PREFILL_DECODE: Final = "prefill_decode"
ROLES = (ENCODE, PREFILL, DECODE, PREFILL_DECODE)
CHAT_PATH = "/v1/chat/completions"


@dataclass(eq=False, slots=True)
class Instance:
    """One vLLM server as the proxy sees it. Identity is the object, so two roles never alias."""

    url: str
    role: str
    # Mooncake EC consumer control addresses, one per data-parallel replica.
    zmq_addrs: tuple[str, ...] = ()
    dp_size: int = 1
    inflight: int = 0
    # As a prefill or PD instance: the work routed to it and not yet through its first token, in
    # prompt tokens (fleet/prefill_cost.py), and how fast it prefills.
    prefill_queue: float = 0.0
    prefill_speed: Speed = field(default_factory=prefill_speed, repr=False)
    # Modalities a consumer takes no raw media of (vLLM's limit per prompt 0 for them, all under
    # --language-model-only), as its probe found (capabilities.py): such items reach it only as
    # embeddings references (journey/reuse.py).
    raw_refused: frozenset[str] = frozenset()
    _dp_cursor: int = field(default=0, repr=False)

    def next_dp_rank(self) -> int:
        rank = self._dp_cursor % self.dp_size
        self._dp_cursor = rank + 1
        return rank
