"""E+P+D over NIXL on real vLLM: 2 encoders store their output in a folder (ECExampleConnector),
prefill loads it and computes the prompt's KV, and decode pulls that KV from prefill over NIXL
(`NixlConnector`, `kv_buffer_device: cpu`, UCX over TCP on loopback); the answers are held
against a plain vLLM instance.

Equal answers alone prove nothing (a decode that recomputed the prompt would match too), so every
case also reads decode's own counters: each prompt token came from `external_kv_transfer`, none
from `local_compute`, and one NIXL transfer ran per request (`vllm:nixl_xfer_time_seconds`).
"""

from __future__ import annotations

import pytest

from epd_proxy_tools.testing.polling import eventually_sync

from .e2e_helpers import (
    NIXL,
    SMALL_SIZE_KWARGS,
    chat_body,
    chat_ok,
    extra_proxy,
    finished_requests,
    image_source,
    metric_total,
    openai_stream,
    prompt_sources,
    settled_encoder_total,
    text_of,
)

pytestmark = pytest.mark.e2e

fresh = image_source(range(50_000, 60_000))
TRANSFERS = "vllm:nixl_xfer_time_seconds_count"


class Pulled:
    """Decode's counters before a request, and what the request added to them."""

    def __init__(self, st) -> None:
        self.url = st.decode_url
        self.sources = prompt_sources(self.url)
        self.transfers = metric_total(self.url, TRANSFERS)

    def after(self, prompt_tokens: int) -> dict[str, float]:
        # vLLM counts from its output loop, a moment after the answer went out.
        def settled() -> dict[str, float] | None:
            now = prompt_sources(self.url)
            added = {k: now[k] - self.sources[k] for k in now}
            added["transfers"] = metric_total(self.url, TRANSFERS) - self.transfers
            return added if sum(added[k] for k in now) >= prompt_tokens and added["transfers"] >= 1 else None

        return eventually_sync(settled, timeout=10, interval=0.2, what="decode's counters did not move")

    def describe(self, added: dict[str, float], prompt_tokens: int) -> str:
        pulled = int(added["external_kv_transfer"])
        return f"{pulled} of {prompt_tokens} prompt tokens over NIXL ({int(added['local_compute'])} computed)"


def assert_pulled(added: dict[str, float], prompt_tokens: int) -> None:
    """Decode computed none of the prompt: it pulled what its own prefix cache did not hold (the
    chat template's blocks, shared by every request, are there after the first)."""
    assert added["local_compute"] == 0, f"decode computed prompt tokens itself: {added}"
    assert added["external_kv_transfer"] > 0, f"decode pulled nothing: {added}"
    assert added["external_kv_transfer"] + added["local_cache_hit"] == prompt_tokens, added
    assert added["transfers"] == 1, added


def test_one_image(nixl_stack, fidelity):
    st = nixl_stack
    (a,) = fresh(1)
    before = settled_encoder_total(st.encoder_urls)
    prefilled = finished_requests(st.prefill_url)
    pulled = Pulled(st)
    body = chat_body([a], logprobs=True, top_logprobs=3)
    got = chat_ok(st.proxy_url, body)
    want = chat_ok(st.baseline_url, body)
    n = want["usage"]["prompt_tokens"]
    added = pulled.after(n)
    fidelity.check("one image", got, want, path=NIXL, kv=pulled.describe(added, n))
    assert_pulled(added, n)
    assert settled_encoder_total(st.encoder_urls, before + 1) == before + 1
    assert finished_requests(st.prefill_url) == prefilled + 1


def test_five_images_with_repeat_over_two_encoders_size_option(nixl_stack, fidelity):
    st = nixl_stack
    a, b, c, d = fresh(4)
    before = settled_encoder_total(st.encoder_urls)
    pulled = Pulled(st)
    body = chat_body([a, b, a, c, d], logprobs=True, top_logprobs=1, mm_processor_kwargs=SMALL_SIZE_KWARGS)
    got = chat_ok(st.proxy_url, body)
    want = chat_ok(st.baseline_url, body)
    n = want["usage"]["prompt_tokens"]
    added = pulled.after(n)
    fidelity.check("A B A C D over 2 encoders, size option", got, want, path=NIXL, kv=pulled.describe(added, n))
    assert_pulled(added, n)
    assert settled_encoder_total(st.encoder_urls, before + 2) == before + 2


def test_streaming_openai_client(nixl_stack, fidelity):
    st = nixl_stack
    (a,) = fresh(1)
    body = chat_body([a])
    want = chat_ok(st.baseline_url, body)
    n = want["usage"]["prompt_tokens"]
    pulled = Pulled(st)
    text, usage = openai_stream(st.proxy_url, body)
    added = pulled.after(n)
    same_usage = usage is not None and usage.prompt_tokens == n
    fidelity.record_text(
        "one image, streamed (openai client)",
        text,
        text_of(want),
        same_usage,
        NIXL,
        pulled.describe(added, n),
    )
    assert text == text_of(want) and same_usage
    assert_pulled(added, n)


def test_text_only(nixl_stack, fidelity):
    st = nixl_stack
    before = settled_encoder_total(st.encoder_urls)
    pulled = Pulled(st)
    body = chat_body([], text="Nothing to see over NIXL.", logprobs=True, top_logprobs=1)
    got = chat_ok(st.proxy_url, body)
    want = chat_ok(st.baseline_url, body)
    n = want["usage"]["prompt_tokens"]
    added = pulled.after(n)
    fidelity.check("text only", got, want, path=NIXL, kv=pulled.describe(added, n))
    assert_pulled(added, n)
    assert settled_encoder_total(st.encoder_urls) == before


def test_zz_control_decode_alone_computes_the_prompt(nixl_stack):
    """The counters can tell: a proxy with no prefill stage sends decode the prompt itself, and
    decode's counters show it computed, none pulled."""
    st = nixl_stack
    (a,) = fresh(1)
    body = chat_body([a])
    with extra_proxy(st, "proxy-decode-alone", decode_url=st.decode_url) as url:
        pulled = Pulled(st)
        got = chat_ok(url, body)
        now = eventually_sync(
            lambda: (s := prompt_sources(st.decode_url))["local_compute"] > pulled.sources["local_compute"] and s,
            timeout=10,
            interval=0.2,
            what="decode's counters did not move",
        )
    assert now["external_kv_transfer"] == pulled.sources["external_kv_transfer"]
    assert text_of(got) == text_of(chat_ok(st.baseline_url, body))
