"""/v1/responses and /v1/messages through the proxy (E+PD and E+P+D) vs the same request straight
to one plain vLLM instance's own endpoints, with the official `openai` and `anthropic` clients."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from epd_proxy_tools.testing.polling import eventually_sync

from .e2e_helpers import (
    EPD,
    MODEL,
    PREFILL,
    image_source,
    kv_loads,
    loaded_hashes,
    settled_encoder_total,
    store_entries,
)

pytestmark = pytest.mark.e2e

fresh = image_source(range(40_000, 50_000))
MAX_TOKENS = 16


def openai_client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def anthropic_client(url: str):
    from anthropic import Anthropic

    return Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)


def responses_input(images: list[str], text: str = "Describe the picture.") -> list[dict]:
    parts = [{"type": "input_text", "text": text}] + [{"type": "input_image", "image_url": u} for u in images]
    return [{"role": "user", "content": parts}]


def messages_input(images: list[str], text: str = "Describe the picture.") -> list[dict]:
    blocks: list[dict] = [{"type": "text", "text": text}]
    for url in images:
        header, data = url.split(",", 1)
        media_type = header[len("data:") : -len(";base64")]
        blocks.append({"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}})
    return [{"role": "user", "content": blocks}]


def turn_after_turn(first_turn, images: list[str]) -> list[dict]:
    """A conversation's last turn: one image per turn, each earlier turn answered "noted"."""
    entries: list[dict] = []
    for n, url in enumerate(images):
        if n:
            entries.append({"role": "assistant", "content": "noted"})
        entries += first_turn([url], text=f"Step {n}: describe it.")
    return entries


def respond(url: str, images: list[str], stream: bool, turns: bool = False) -> tuple[str, dict, str]:
    """(text, usage, status) of one Responses call; `turns`: one image per turn, not all in one."""
    client = openai_client(url)
    args = dict(
        model=MODEL,
        input=turn_after_turn(responses_input, images) if turns else responses_input(images),
        instructions="Answer briefly.",
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    if not stream:
        response = client.responses.create(**args)
        return response.output_text, response.usage.model_dump(), response.status
    pieces, final = [], None
    for event in client.responses.create(**args, stream=True):
        if event.type == "response.output_text.delta":
            pieces.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None, "the stream did not finish"
    assert "".join(pieces) == final.output_text
    return "".join(pieces), final.usage.model_dump(), final.status


def message(url: str, images: list[str], stream: bool, turns: bool = False) -> tuple[str, dict, str]:
    """(text, usage, stop_reason) of one Messages call; `turns` as for `respond`."""
    client = anthropic_client(url)
    args = dict(
        model=MODEL,
        system="Answer briefly.",
        messages=turn_after_turn(messages_input, images) if turns else messages_input(images),
        max_tokens=MAX_TOKENS,
        stop_sequences=["zzz"],
        # This SDK's signature has no temperature; vLLM reads it from the body all the same.
        extra_body={"temperature": 0},
    )
    if not stream:
        answer = client.messages.create(**args)
    else:
        with client.messages.stream(**args) as streamed:
            pieces = list(streamed.text_stream)
            answer = streamed.get_final_message()
        assert "".join(pieces) == "".join(b.text for b in answer.content if b.type == "text")
    text = "".join(b.text for b in answer.content if b.type == "text")
    return text, answer.usage.model_dump(), answer.stop_reason


CALLS = {"responses": respond, "messages": message}
CASES = [("one image", 1, False), ("A B A", 3, False), ("one image, streamed", 1, True), ("A B A, streamed", 3, True)]


def pictures(count: int) -> list[str]:
    if count == 1:
        return fresh(1)
    a, b = fresh(2)
    return [a, b, a]


def kv_split(usage: dict) -> tuple[dict, int | None]:
    """Responses usage with its prompt-cache split folded, and how many tokens were read from
    cache. In E+P+D, decode gets the prompt's KV from prefill and vLLM counts those tokens as
    cached where a single instance writes them; the split is the handover, not a difference."""
    details = usage.get("input_tokens_details")
    if not details:
        return usage, None
    cached = details["cached_tokens"]
    folded = {**details, "cached_tokens": None, "cache_write_tokens": cached + details["cache_write_tokens"]}
    return {**usage, "input_tokens_details": folded}, cached


def compare(st, fidelity, path: str, api: str, case: str, count: int, stream: bool) -> None:
    images = pictures(count)
    loads_before = len(kv_loads(st.log_path("decode"))) if path == PREFILL else 0
    got = CALLS[api](st.proxy_url, images, stream)
    want = CALLS[api](st.baseline_url, images, stream)
    kv = "n/a"
    if path == PREFILL:
        # Logged before decode's first forward pass, but the log file may trail a moment.
        eventually_sync(
            lambda: kv_loads(st.log_path("decode"))[loads_before:],
            timeout=10,
            interval=0.2,
            what=f"decode loaded no KV from prefill for /v1/{api} {case}",
        )
        kv = f"{kv_loads(st.log_path('decode'))[-1]} tokens"
    if path == PREFILL and api == "responses":
        (got_usage, cached), (want_usage, _) = kv_split(got[1]), kv_split(want[1])
        assert cached, f"decode read nothing of the prompt from prefill: {got[1]}"
        kv += f" ({cached} cached in usage)"
        got, want = (got[0], got_usage, got[2]), (want[0], want_usage, want[2])
    fidelity.record_text(f"/v1/{api}: {case}", got[0], want[0], got[1] == want[1], path=path, kv=kv)
    assert got == want, f"{path} /v1/{api} {case}: proxy answer differs from the baseline"


@pytest.mark.parametrize("api", ["responses", "messages"])
@pytest.mark.parametrize("case, count, stream", CASES, ids=[c[0] for c in CASES])
def test_e_pd_answers_equal_a_single_instance(stack, fidelity, api, case, count, stream):
    compare(stack, fidelity, EPD, api, case, count, stream)


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_e_pd_consumer_loads_the_encoders_embeddings(stack, api):
    before = store_entries(stack.ec_store)
    images = pictures(3)
    CALLS[api](stack.proxy_url, images, False)
    new = {h: ok for h, ok in store_entries(stack.ec_store).items() if h not in before}
    assert len(new) == 2 and all(new.values()), f"expected one EC entry per distinct image: {new}"
    assert set(new) <= set(loaded_hashes(stack.log_path("pd"))), "PD encoded by itself"


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_e_pd_a_conversation_sends_the_encoders_only_each_turns_new_image(stack, api):
    """Each turn re-sends the history: its images go raw to the PD that holds them, and only the
    new one is encoded (with 2 images or more, re-encoding would take both encoders)."""
    images, turns = fresh(3), 3
    encoded = settled_encoder_total(stack.encoder_urls)
    for n in range(1, turns + 1):
        got = CALLS[api](stack.proxy_url, images[:n], False, turns=True)
        assert got == CALLS[api](stack.baseline_url, images[:n], False, turns=True), f"/v1/{api} turn {n}"
    assert settled_encoder_total(stack.encoder_urls, encoded + turns) == encoded + turns


def raw_post(url: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + path, data=body, headers={"Content-Type": "application/json", **(headers or {})}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


BAD_BODIES = [
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}),
    ("/v1/responses", {"model": MODEL}),
    # An unknown item type: vLLM's own 400. (An unknown part type in a list vLLM parses as content is
    # the proxy's own 400, in the same shape: the next test.)
    ("/v1/responses", {"model": MODEL, "input": [{"type": "bogus"}]}),
]


@pytest.mark.parametrize("path, body", BAD_BODIES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_BODIES)])
def test_bad_bodies_get_the_single_instances_4xx_in_its_shape(stack, path, body):
    raw = json.dumps(body).encode()
    got_status, got = raw_post(stack.proxy_url, path, raw)
    want_status, want = raw_post(stack.baseline_url, path, raw)
    assert 400 <= want_status < 500 and got_status == want_status
    assert got == want


def test_a_part_of_no_known_type_is_a_400_in_the_single_instances_shape(stack):
    # The proxy reads content parts as vLLM's chat parser does and refuses one of no known type
    # itself (it could not tell what vLLM would make of it): the status and error shape are vLLM's.
    body = {"model": MODEL, "input": [{"role": "user", "content": [{"type": "bogus"}]}]}
    raw = json.dumps(body).encode()
    got_status, got = raw_post(stack.proxy_url, "/v1/responses", raw)
    want_status, want = raw_post(stack.baseline_url, "/v1/responses", raw)
    assert got_status == want_status == 400
    assert set(got) == set(want) == {"error"} and {"message", "type", "code"} <= set(got["error"]) & set(want["error"])
    assert got["error"]["code"] == want["error"]["code"] == 400 and "bogus" in got["error"]["message"]


@pytest.mark.parametrize("api", ["responses", "messages"])
@pytest.mark.parametrize("case, count, stream", CASES[1:3], ids=[c[0] for c in CASES[1:3]])
def test_e_p_d_answers_equal_a_single_instance(prefill_stack, fidelity, api, case, count, stream):
    compare(prefill_stack, fidelity, PREFILL, api, case, count, stream)
