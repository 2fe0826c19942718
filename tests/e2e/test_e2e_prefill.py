"""E+P+D on real vLLM: the proxy (2 encoders, prefill, decode) vs a single plain vLLM instance.

Prefill (EC consumer, KV producer) saves the prompt's KV into a folder with vLLM's disk-based
ExampleConnector; decode (KV consumer, and EC consumer for the prompt tail it recomputes) loads
it. Equal answers alone prove nothing here: a proxy that skipped prefill would match too. So
every case also shows that prefill ran (its finished-request counter, the KV folder it saved,
named by the prompt's tokens and media hashes) and that decode loaded that KV (its "Inject KV
cache of N tokens" log line). Two controls at the end show those checks can fail.

Tests run in file order; the corrupted-KV control is last because decode keeps what it loaded.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import pytest

from epd_proxy_tools.local.stack import LocalStack

from .e2e_helpers import (
    LOWERCASE_IDS,
    MODEL,
    PREFILL,
    SMALL_SIZE_KWARGS,
    chat_body,
    chat_ok,
    comparable,
    finished_requests,
    image_source,
    kv_entries,
    kv_folder,
    kv_loads,
    kv_saved_tokens,
    settled_encoder_total,
    store_entries,
    text_of,
    zero_safetensors,
)

pytestmark = pytest.mark.e2e

# Fresh pictures per case: decode's prefix cache would otherwise already hold the prompt and
# load nothing.
fresh = image_source(range(20_000, 30_000))


@dataclass
class Handover:
    """What one request left on the prefill -> decode path."""

    prefill_runs: float
    new_kv: dict[str, list[str]]
    loads: list[int]

    def describe(self, prompt_tokens: int) -> str:
        if not self.loads:
            return f"nothing (prefill ran {self.prefill_runs:g}x)"
        return f"{'+'.join(map(str, self.loads))} of {prompt_tokens} prompt tokens"


class Watch:
    """Reads prefill's counter, the KV store and decode's log before a request, and the change after."""

    def __init__(self, st: LocalStack):
        self.st = st
        self.prefill_done = finished_requests(st.prefill_url)
        self.kv = kv_entries(st.kv_store)
        self.loads = len(kv_loads(st.log_path("decode")))

    def after(self, expect_load: bool = True, timeout: float = 10.0) -> Handover:
        # vLLM bumps counters from its output loop, a moment after the answer went out; the
        # log line comes before decode's first forward pass. Poll for both, with a deadline.
        deadline = time.monotonic() + timeout
        while True:
            runs = finished_requests(self.st.prefill_url) - self.prefill_done
            loads = kv_loads(self.st.log_path("decode"))[self.loads :]
            if (runs >= 1 and (loads or not expect_load)) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        new = {k: v for k, v in kv_entries(self.st.kv_store).items() if k not in self.kv}
        return Handover(runs, new, loads)


def media_keys(pattern: str, new_ec: list[str]) -> list[list[str]]:
    """Every way the new EC entries can stand for the pictures of ``pattern`` (e.g. "ABACD")."""
    letters = sorted(set(pattern))
    if len(new_ec) != len(letters):
        return []
    return [[dict(zip(letters, perm))[ch] for ch in pattern] for perm in itertools.permutations(new_ec)]


def assert_handover(st: LocalStack, h: Handover, want: dict, mm_keys: list[list[str]]) -> None:
    """Prefill ran once and saved this prompt's KV under its own key; decode loaded exactly that."""
    block = st.config.kv_block_size
    n = want["usage"]["prompt_tokens"]
    assert (n - 1) % block, (
        f"test design: with {n} prompt tokens prefill saves and decode looks up under different keys "
        "(ExampleConnector), so nothing would be handed over; change the prompt's length"
    )
    assert h.prefill_runs == 1, f"prefill finished {h.prefill_runs} requests, expected 1"
    assert len(h.new_kv) == 1, f"expected prefill to save one KV folder, got {h.new_kv}"
    ((folder, files),) = h.new_kv.items()
    assert files, f"KV folder {folder} holds no layer files"
    keys = {kv_folder(want["prompt_token_ids"], block, mm) for mm in mm_keys}
    assert folder in keys, "the saved KV is not keyed by this prompt's tokens and media"
    assert h.loads == [kv_saved_tokens(n, block)], f"decode loaded {h.loads}, expected one load of whole blocks"


def baseline_with_ids(st: LocalStack, body: dict) -> dict:
    """The baseline's answer plus the prompt's token ids (to name the KV folder)."""
    return chat_ok(st.baseline_url, {**body, "return_token_ids": True})


def new_ec_entries(st: LocalStack, before: dict[str, bool]) -> list[str]:
    new = {h: ok for h, ok in store_entries(st.ec_store).items() if h not in before}
    assert all(new.values()), f"empty EC store folders (consumer misses): {new}"
    return sorted(new)


# ---------------------------------------------------------------- sensitivity
def test_baseline_is_sensitive_to_inputs(prefill_stack):
    """This baseline runs with --block-size 32; it too must tell inputs apart, or matching it proves nothing."""
    base = prefill_stack.baseline_url
    a, b = fresh(2)
    ans = {
        "A": text_of(chat_ok(base, chat_body([a]))),
        "B": text_of(chat_ok(base, chat_body([b]))),
        "A small": text_of(chat_ok(base, chat_body([a], mm_processor_kwargs=SMALL_SIZE_KWARGS))),
        "text": text_of(chat_ok(base, chat_body([]))),
    }
    for x, y in [("A", "B"), ("A", "A small"), ("A", "text")]:
        assert ans[x] != ans[y], f"baseline answers {x!r} and {y!r} are both {ans[x]!r}"


# ------------------------------------------------------------------ fidelity
def test_one_image(prefill_stack, fidelity):
    st = prefill_stack
    (a,) = fresh(1)
    ec_before = store_entries(st.ec_store)
    enc_before = settled_encoder_total(st.encoder_urls)
    watch = Watch(st)
    body = chat_body([a], logprobs=True, top_logprobs=3)
    got = chat_ok(st.proxy_url, body)
    h = watch.after()
    want = baseline_with_ids(st, body)
    fidelity.check("one image", got, want, path=PREFILL, kv=h.describe(want["usage"]["prompt_tokens"]))
    assert got["choices"][0]["logprobs"]["content"], "logprobs were requested"
    assert settled_encoder_total(st.encoder_urls, enc_before + 1) == enc_before + 1
    new_ec = new_ec_entries(st, ec_before)
    assert len(new_ec) == 1, new_ec
    assert_handover(st, h, want, media_keys("A", new_ec))


def test_five_images_with_repeat_over_two_encoders_size_option(prefill_stack, fidelity):
    st = prefill_stack
    a, b, c, d = fresh(4)
    ec_before = store_entries(st.ec_store)
    enc_before = settled_encoder_total(st.encoder_urls)
    watch = Watch(st)
    body = chat_body([a, b, a, c, d], logprobs=True, top_logprobs=1, mm_processor_kwargs=SMALL_SIZE_KWARGS)
    got = chat_ok(st.proxy_url, body)
    h = watch.after()
    enc_after = settled_encoder_total(st.encoder_urls, enc_before + 2)
    want = baseline_with_ids(st, body)
    fidelity.check(
        "A B A C D over 2 encoders, size option", got, want, path=PREFILL, kv=h.describe(want["usage"]["prompt_tokens"])
    )
    # Round robin over 2 encoders, no batch cap: one sub-request per encoder.
    assert enc_after - enc_before == 2
    new_ec = new_ec_entries(st, ec_before)
    assert len(new_ec) == 4, f"expected one EC entry per distinct picture, got {new_ec}"
    # The KV key names the five pictures in prompt order, under the hashes the encoders stored.
    assert_handover(st, h, want, media_keys("ABACD", new_ec))


def test_streaming_openai_client(prefill_stack, fidelity):
    from openai import OpenAI

    st = prefill_stack
    a, b = fresh(2)
    body = chat_body([a, b], logprobs=True, top_logprobs=2)
    ec_before = store_entries(st.ec_store)
    watch = Watch(st)
    client = OpenAI(base_url=st.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=body["messages"],
        temperature=0,
        seed=body["seed"],
        max_tokens=body["max_tokens"],
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"allowed_token_ids": LOWERCASE_IDS},
    )
    pieces, tokens, usage, finish = [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta and ch.delta.content:
                pieces.append(ch.delta.content)
            if ch.logprobs and ch.logprobs.content:
                tokens += [
                    (t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs]) for t in ch.logprobs.content
                ]
            if ch.finish_reason:
                finish = ch.finish_reason
    h = watch.after()
    want = baseline_with_ids(st, body)
    want_tokens = [
        (t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top_logprobs"]])
        for t in want["choices"][0]["logprobs"]["content"]
    ]
    usage_same = usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (
        want["usage"]["prompt_tokens"],
        want["usage"]["completion_tokens"],
    )
    fidelity.record_text(
        "two images, streamed (openai client)",
        "".join(pieces),
        text_of(want),
        usage_same,
        path=PREFILL,
        kv=h.describe(want["usage"]["prompt_tokens"]),
        logprobs="same" if tokens == want_tokens else "DIFFERENT",
    )
    assert "".join(pieces) == text_of(want)
    assert tokens == want_tokens
    assert usage_same
    assert finish == want["choices"][0]["finish_reason"]
    assert_handover(st, h, want, media_keys("AB", new_ec_entries(st, ec_before)))


def test_text_only(prefill_stack, fidelity):
    st = prefill_stack
    enc_before = settled_encoder_total(st.encoder_urls)
    watch = Watch(st)
    body = chat_body([], text="Say something about nothing at all, please.", logprobs=True, top_logprobs=2)
    got = chat_ok(st.proxy_url, body)
    h = watch.after()
    want = baseline_with_ids(st, body)
    fidelity.check("text only", got, want, path=PREFILL, kv=h.describe(want["usage"]["prompt_tokens"]))
    assert settled_encoder_total(st.encoder_urls) == enc_before, "text only must not reach the encoders"
    assert_handover(st, h, want, [[]])


def test_min_tokens_is_left_to_decode(prefill_stack, fidelity):
    """vLLM refuses min_tokens above max_tokens: prefill (one token) must not get the client's."""
    st = prefill_stack
    (a,) = fresh(1)
    ec_before = store_entries(st.ec_store)
    watch = Watch(st)
    body = chat_body([a], min_tokens=12, logprobs=True)
    got = chat_ok(st.proxy_url, body)
    h = watch.after()
    want = baseline_with_ids(st, body)
    fidelity.check("one image, min_tokens 12", got, want, path=PREFILL, kv=h.describe(want["usage"]["prompt_tokens"]))
    assert_handover(st, h, want, media_keys("A", new_ec_entries(st, ec_before)))


# ------------------------------------------------------------ controls, LAST
def test_zy_control_skipped_prefill_is_caught(prefill_stack):
    """A proxy that sends the request straight to decode gets the baseline's answer anyway
    (decode just computes everything); only the handover check can tell, and it does."""
    st = prefill_stack
    body = chat_body([], text="Describe a bicycle that never learned to ride.")
    watch = Watch(st)
    got = chat_ok(st.decode_url, body)
    h = watch.after(expect_load=False, timeout=3.0)
    want = baseline_with_ids(st, body)
    assert comparable(got) == comparable(want), "answers alone cannot show a skipped prefill"
    assert h.prefill_runs == 0 and h.loads == [], h
    with pytest.raises(AssertionError):
        assert_handover(st, h, want, [[]])


def test_zz_control_corrupted_kv_changes_the_answer(prefill_stack):
    """Decode really answers from the KV prefill saved: zero it between prefill and decode and the
    answer changes. Its own system prompt keeps even the first block apart from every other test's
    (decode writes what it loads into its prefix cache)."""
    from epd_proxy.journey.prefill import prefill_request

    st = prefill_stack
    body = chat_body([], text="Tell me about a quiet lighthouse.")
    body["messages"].insert(0, {"role": "system", "content": "Negative control: its saved memory gets wiped."})
    want = baseline_with_ids(st, body)
    assert (want["usage"]["prompt_tokens"] - 1) % st.config.kv_block_size, "test design: change the prompt's length"
    watch = Watch(st)
    # What the proxy sends to prefill, then what it sends to decode; here with a wipe in between.
    chat_ok(st.prefill_url, prefill_request(body))
    saved = {k: v for k, v in kv_entries(st.kv_store).items() if k not in watch.kv}
    assert list(saved) == [kv_folder(want["prompt_token_ids"], st.config.kv_block_size, [])], saved
    for name in next(iter(saved.values())):
        zero_safetensors(st.kv_store / next(iter(saved)) / name)
    got = chat_ok(st.decode_url, body)
    h = watch.after()
    assert h.loads == [kv_saved_tokens(want["usage"]["prompt_tokens"], st.config.kv_block_size)], h
    assert text_of(got) != text_of(want), "decode answered right from wiped KV: it did not use the loaded KV"
