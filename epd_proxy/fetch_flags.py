"""The flags of media behind http(s) URLs, which the proxy fetches itself (calls/media.py): the
part of `serve`'s configuration between the reference proxy's flags and the rest of ours.
Declared as every option is (options.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epd_proxy import options as options_module
from epd_proxy.addresses import Hosts, IPNetworks, Networks
from epd_proxy.options import Count, Kind, Seconds
from epd_proxy.reference_flags import ReferenceFlags

# Their section of `epd-proxy serve --help` (config.GROUPS orders them).
MEDIA = "media behind http(s) URLs"


def option(default: Any, kind: Kind, help: str, **declaration: Any) -> Any:  # in `MEDIA` unless told
    return options_module.option(default, kind, help, **{"group": MEDIA, **declaration})


@dataclass(frozen=True, slots=True)
class MediaFetchFlags(ReferenceFlags):
    # vLLM fetches an http(s) URL with VLLM_{IMAGE,AUDIO,VIDEO}_FETCH_TIMEOUT (5, 10, 30 s) and
    # retries; the proxy fetches once, so its one deadline is the most generous of the three.
    media_fetch_timeout_s: float = option(
        30.0,
        Seconds(positive=True),
        "seconds to fetch one http(s) media URL (connect to last byte, redirects included); then 400",
        flag="--media-fetch-timeout",
    )
    media_fetch_max_bytes: int = option(
        32 * 1024 * 1024,
        Count(1),
        "larger media behind an http(s) URL are a 400",
        flag="--media-fetch-max-bytes",
    )
    media_fetch_max_redirects: int = option(
        5,
        Count(0, 20),
        "redirects followed per media URL, each target checked like the URL itself; 0 = none, as "
        "`VLLM_MEDIA_URL_ALLOW_REDIRECTS=0`",
        flag="--media-fetch-max-redirects",
    )
    media_fetch_allow_networks: IPNetworks = option(
        IPNetworks(),
        Networks(),
        "private, loopback, link-local and other non-public networks (CIDR, comma list) the proxy may fetch media "
        "from; by default it fetches from public addresses only",
        flag="--media-fetch-allow-networks",
    )
    allowed_media_domains: tuple[str, ...] = option(
        (),
        Hosts(),
        "host names media URLs may name (comma list), as `vllm serve --allowed-media-domains`; empty: any",
        flag="--allowed-media-domains",
    )
    media_fetch_cache_bytes: int = option(
        64 * 1024 * 1024,
        Count(0),
        "memory for fetched media kept by URL while their origin says they are fresh; 0 = off",
        flag="--media-fetch-cache-bytes",
    )
    media_fetch_cache_ttl_s: float = option(
        60.0,
        Seconds(),
        "longest a fetched medium is reused without asking its origin again, whatever freshness the origin allows",
        flag="--media-fetch-cache-ttl",
    )
