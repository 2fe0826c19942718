"""What the engines did: vLLM's own `/metrics`, read before and after a block, and the CPU of each
engine's process tree when it runs on this machine.

Everything here is counted by the engines, not by the proxy, so it holds for any proxy in front of
them: encoder sub-requests are an encoder's finished requests, images are the items its
multimodal processor looked up (`vllm:mm_cache_queries`, one per item whether or not it hit).
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from epd_proxy_tools.bench import procs

ENCODE, PD, PREFILL, DECODE, BASELINE = "encode", "pd", "prefill", "decode", "baseline"

# vLLM 0.32's names (vllm/v1/metrics/loggers.py); counters are summed over their label sets.
COUNTERS = {
    "requests": "vllm:request_success",
    "mm_items": "vllm:mm_cache_queries",
    "mm_hits": "vllm:mm_cache_hits",
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "prefix_queries": "vllm:prefix_cache_queries",
    "prefix_hits": "vllm:prefix_cache_hits",
}
# Counters read from one label set: the prompt tokens an engine prefilled itself, not those its
# prefix cache or a KV transfer supplied (vllm/v1/metrics/stats.py, PromptTokenStats).
LABELLED_COUNTERS = {"prompt_computed": ("vllm:prompt_tokens_by_source", "source", "local_compute")}
# Histograms: their sum and count give a mean per request over a block.
HISTOGRAMS = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}
# Dev-mode endpoints (VLLM_SERVER_DEV_MODE=1) that empty an engine's caches between blocks.
RESETS = ("/reset_mm_cache", "/reset_encoder_cache", "/reset_prefix_cache")


@dataclass
class Engine:
    name: str
    role: str
    url: str
    # Leader of the engine's process tree on this machine (vLLM runs its engine core as a child).
    pid: int | None = None

    def scrape(self, timeout: float = 10.0) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=timeout) as resp:
            text = resp.read().decode()
        out = parse_metrics(text)
        if self.pid is not None:
            user, system = procs.tree_cpu_split(self.pid)
            out["cpu_s"] = user + system
        return out

    def reset_caches(self, timeout: float = 30.0) -> bool:
        """Empty the engine's multimodal, encoder and prefix caches; False when it does not offer
        the endpoints (not started with VLLM_SERVER_DEV_MODE=1)."""
        for path in RESETS:
            request = urllib.request.Request(self.url + path, data=b"", method="POST")
            try:
                with urllib.request.urlopen(request, timeout=timeout):
                    pass
            except urllib.error.HTTPError as exc:
                if exc.code in (404, 405):
                    return False
                raise
        return True


def listening_pid(url: str) -> int | None:
    """The process on this machine listening on `url`'s port, if the URL is local and the process is
    visible to us: how a deployment started by hand still gets its engines' CPU measured."""
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return None
    port = parts.port or 80
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local_address is HEX_IP:HEX_PORT; state 0A is LISTEN.
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    owners = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                owners.append(int(pid))
        except OSError:
            continue
    # A server that forks keeps the socket in its children too; the oldest holder leads the tree.
    return min(owners) if owners else None


def parse_metrics(text: str) -> dict[str, float]:
    wanted_counters = {name: key for key, name in COUNTERS.items()}
    wanted_histograms = {name: key for key, name in HISTOGRAMS.items()}
    wanted_labelled = {name: (key, label, value) for key, (name, label, value) in LABELLED_COUNTERS.items()}
    out = {key: 0.0 for key in (*COUNTERS, *LABELLED_COUNTERS)}
    for key in HISTOGRAMS:
        out[key + "_sum"] = out[key + "_count"] = 0.0
    for family in text_string_to_metric_families(text):
        if family.name in wanted_counters:
            key = wanted_counters[family.name]
            out[key] += sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.name in wanted_labelled:
            key, label, value = wanted_labelled[family.name]
            out[key] += sum(
                s.value for s in family.samples if s.name.endswith("_total") and s.labels.get(label) == value
            )
        elif family.name in wanted_histograms:
            key = wanted_histograms[family.name]
            for s in family.samples:
                if s.name.endswith("_sum"):
                    out[key + "_sum"] += s.value
                elif s.name.endswith("_count"):
                    out[key + "_count"] += s.value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0.0) for key in after}


def scrape_all(engines: list[Engine]) -> dict[str, dict[str, float]]:
    return {e.name: e.scrape() for e in engines}


def settled(engines: list[Engine], deadline_s: float = 15.0, every_s: float = 0.25) -> dict[str, dict[str, float]]:
    """A scrape once the request counters have stopped moving: vLLM counts a finished request
    after its answer has gone out, so a scrape right after the last answer can miss it."""

    def counts(scrape):
        return {name: (m["requests"], m["mm_items"]) for name, m in scrape.items()}

    end = time.monotonic() + deadline_s
    last = scrape_all(engines)
    while time.monotonic() < end:
        time.sleep(every_s)
        now = scrape_all(engines)
        if counts(now) == counts(last):
            return now
        last = now
    return last


def summarise(engines: list[Engine], deltas: dict[str, dict[str, float]], requests: int) -> dict[str, float | None]:
    """Per-request figures of one block from the engines' counter deltas."""
    n = max(1, requests)

    def total(role: str, key: str) -> float:
        return sum(deltas[e.name].get(key, 0.0) for e in engines if e.role == role)

    def mean_ms(roles: tuple[str, ...], key: str) -> float | None:
        count = sum(total(r, key + "_count") for r in roles)
        return 1000 * sum(total(r, key + "_sum") for r in roles) / count if count else None

    encoder_requests = total(ENCODE, "requests")
    out: dict[str, float | None] = {
        "encoder_subrequests_per_request": encoder_requests / n,
        "images_per_subrequest": total(ENCODE, "mm_items") / encoder_requests if encoder_requests else None,
        "encoder_images_per_request": total(ENCODE, "mm_items") / n,
        "encoder_cache_hit_share": (total(ENCODE, "mm_hits") / total(ENCODE, "mm_items"))
        if total(ENCODE, "mm_items")
        else None,
    }
    # The stage that runs the language model first: PD, or prefill in E+P+D.
    first = (PREFILL,) if any(e.role == PREFILL for e in engines) else (PD,)
    last = (DECODE,) if any(e.role == DECODE for e in engines) else (PD,)
    out["queue_ms"] = mean_ms(first, "queue")
    out["prefill_ms"] = mean_ms(first, "prefill")
    out["decode_ms"] = mean_ms(last, "decode")
    out["encoder_queue_ms"] = mean_ms((ENCODE,), "queue")
    # An encoder's "prefill" of a sub-request is its media's encode: vLLM's own time for the work.
    out["encoder_prefill_ms"] = mean_ms((ENCODE,), "prefill")
    # Engines count their own request attempts: more than one per client request means retries.
    out["consumer_requests_per_request"] = total(first[0], "requests") / n
    out["prompt_tokens_per_request"] = total(first[0], "prompt_tokens") / n
    out["prompt_tokens_computed_per_request"] = total(first[0], "prompt_computed") / n
    queried = total(first[0], "prefix_queries")
    out["prefix_cache_hit_share"] = total(first[0], "prefix_hits") / queried if queried else None
    for role in (ENCODE, PD, PREFILL, DECODE):
        members = [e for e in engines if e.role == role and "cpu_s" in deltas[e.name]]
        if members:
            out[f"{role}_cpu_ms_per_request"] = 1000 * sum(deltas[e.name]["cpu_s"] for e in members) / n
    with_cpu = [e for e in engines if e.role != BASELINE and "cpu_s" in deltas[e.name]]
    if with_cpu:
        out["engine_cpu_ms_per_request"] = 1000 * sum(deltas[e.name]["cpu_s"] for e in with_cpu) / n
    return out
