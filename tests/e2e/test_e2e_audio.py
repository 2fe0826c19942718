"""Audio through the proxy on real vLLM: the tiny Qwen2-Audio model (seeded random weights, built
offline) behind one encoder + PD, exact against a single plain vLLM instance (text, usage,
logprobs), for `input_audio` and `audio_url` parts.

vLLM 0.32's EC connector carries Qwen2-Audio: its producer publishes `audio_num_tokens` (the
placeholder length) as the item's metadata, and PD loads the embedding from the store. The
all-or-nothing rule is shown on the real engine too: with one audio item reported without metadata
(a relay empties it), every item goes to PD as raw media with its uuid, PD still loads every
embedding, and the answer is exact; what the rule prevents, raw audio next to an audio reference,
is vLLM's own 400.
"""

from __future__ import annotations

import hashlib

import pytest

from epd_proxy_tools.local.up import example_body

from .e2e_helpers import (
    AUDIO,
    chat_ok,
    comparable,
    extra_proxy,
    loaded_hashes,
    post_json,
    settled_encoder_total,
    store_entries,
)
from .e2e_helpers import text_of as text
from .media_helpers import (
    AUDIO_MODEL,
    MetadataStripper,
    audio_source,
    audio_url_part,
    input_audio_part,
    media_body,
)

pytestmark = pytest.mark.e2e

fresh = audio_source(range(60_000, 70_000))


def body(parts: list[dict], **extra) -> dict:
    return media_body(parts, text="What do you hear?", model=AUDIO_MODEL, **extra)


def new_entries(st, before: dict[str, bool]) -> dict[str, bool]:
    return {h: ok for h, ok in store_entries(st.ec_store).items() if h not in before}


def test_audio_baseline_is_sensitive_to_the_sound(audio_stack):
    """Exact matching proves something only if the answer depends on the sound. The tiny audio
    model's greedy text often repeats one letter whatever it hears, so the comparison (like the
    fidelity checks) includes the logprobs, which always move with the input."""
    base = audio_stack.baseline_url
    a, b = fresh(2)

    def answer(parts: list[dict]) -> dict:
        return comparable(chat_ok(base, body(parts, logprobs=True, top_logprobs=3)))

    ans = {
        "A": answer([input_audio_part(a)]),
        "B": answer([input_audio_part(b)]),
        "A as audio_url": answer([audio_url_part(a)]),
        "AB": answer([input_audio_part(a), input_audio_part(b)]),
        "BA": answer([input_audio_part(b), input_audio_part(a)]),
        "text": answer([]),
    }
    for x, y in [("A", "B"), ("AB", "BA"), ("A", "text")]:
        assert ans[x]["choices"] != ans[y]["choices"], f"baseline answers {x!r} and {y!r} are the same"
    # the same waveform either way
    assert ans["A"] == ans["A as audio_url"]


@pytest.mark.parametrize("make_part", [input_audio_part, audio_url_part], ids=["input_audio", "audio_url"])
def test_one_audio_item(audio_stack, fidelity, make_part):
    st = audio_stack
    (a,) = fresh(1)
    before_store = store_entries(st.ec_store)
    before_enc = settled_encoder_total(st.encoder_urls)
    request = body([make_part(a)], logprobs=True, top_logprobs=3)
    got = chat_ok(st.proxy_url, request)
    fidelity.check(f"one {make_part(a)['type']}", got, chat_ok(st.baseline_url, request), path=AUDIO)
    assert settled_encoder_total(st.encoder_urls, before_enc + 1) == before_enc + 1
    new = new_entries(st, before_store)
    assert len(new) == 1 and all(new.values()), new
    assert set(new) <= set(loaded_hashes(st.log_path("pd"))), "PD did not load E's audio embedding"


def test_input_audio_and_audio_url_in_one_request(audio_stack, fidelity):
    st = audio_stack
    a, b = fresh(2)
    before_store = store_entries(st.ec_store)
    before_enc = settled_encoder_total(st.encoder_urls)
    request = body([input_audio_part(a), audio_url_part(b), input_audio_part(a)], logprobs=True, top_logprobs=2)
    got = chat_ok(st.proxy_url, request)
    after_enc = settled_encoder_total(st.encoder_urls, before_enc + 3)
    fidelity.check("input_audio A, audio_url B, input_audio A", got, chat_ok(st.baseline_url, request), path=AUDIO)
    # audio items are singletons: one sub-request per occurrence
    assert after_enc - before_enc == 3
    new = new_entries(st, before_store)
    assert len(new) == 2 and all(new.values()), new
    assert set(new) <= set(loaded_hashes(st.log_path("pd")))


def test_audio_all_or_nothing_when_one_item_has_no_metadata(audio_stack, fidelity):
    """Round robin over [the encoder, a relay that empties its metadata]: the first audio item has
    metadata, the second not, so both go to PD raw with their uuids; PD still loads both."""
    st = audio_stack
    a, b = fresh(2)
    request = body([input_audio_part(a), audio_url_part(b)], logprobs=True, top_logprobs=2)
    want = chat_ok(st.baseline_url, request)
    before_store = store_entries(st.ec_store)
    loaded_before = len(loaded_hashes(st.log_path("pd")))
    with MetadataStripper(st.encoder_urls[0]) as relay:
        encoders = [st.encoder_urls[0], relay.url]
        with extra_proxy(st, "stripping-proxy", "--encode-policy", "round_robin", encoder_urls=encoders) as url:
            got = chat_ok(url, request)
        assert relay.stripped == 1, "exactly one audio item must have come back without metadata"
    fidelity.check("two audio items, one without metadata: all raw", got, want, path=AUDIO)
    new = new_entries(st, before_store)
    assert len(new) == 2 and all(new.values()), new
    assert set(new) <= set(loaded_hashes(st.log_path("pd"))[loaded_before:]), "PD encoded an item itself"

    # What the rule prevents, on the real engine: an audio reference next to raw audio is a 400.
    (c, d) = fresh(2)
    uuid = hashlib.sha256(c.encode()).hexdigest()
    enc = chat_ok(
        st.encoder_urls[0],
        {"model": AUDIO_MODEL, "messages": [{"role": "user", "content": [{**input_audio_part(c), "uuid": uuid}]}]},
    )
    metadata = enc["ec_transfer_params"][uuid]["metadata"]
    assert set(metadata) == {"audio_num_tokens"}, metadata
    reference = {"type": "audio_embeds", "audio_embeds": metadata, "uuid": uuid}
    status, data = post_json(st.pd_url, body([reference, input_audio_part(d)]))
    assert status == 400 and "Mixing raw audio and embedding inputs is not allowed" in str(data), (status, data)
    assert chat_ok(st.pd_url, body([reference]))["choices"], "the reference alone is fine"


def test_up_audio_example_request_is_answered(audio_stack):
    """The request `epd-proxy up --model-kind audio` prints works against the real stack."""
    body = example_body("audio", audio_stack.model_name)
    got = text(chat_ok(audio_stack.proxy_url, body))
    # Noise from random weights, but at temperature 0 the same noise every time.
    assert got and text(chat_ok(audio_stack.proxy_url, body)) == got
