"""The normalising pass against the pinned vLLM's own chat parser, not against our fake of it.

Whatever the proxy accepts, every body it forwards (encoder sub-requests, consumer bodies in both
modes) is read by vLLM's request model and part parser: vLLM must give each media part the kind the
proxy gave it, and see no embeddings or cache reference and no uuid the proxy did not make. No
servers are started; only vLLM's parsing code is imported.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd_proxy.errors import BadRequest
from epd_proxy.journey.extract import REFERENCE_KINDS, TEXT_TYPES, normalise_request
from epd_proxy.journey.match import Matches
from epd_proxy.journey.responses_api import normalise_responses, responses_consumer_body
from epd_proxy.journey.rewrite import rewrite_request
from epd_proxy.journey.subrequest import encoder_body
from tests.matching import every_item_matched

pytestmark = pytest.mark.e2e
protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
chat_utils = pytest.importorskip("vllm.renderers.chat_utils")
responses_protocol = pytest.importorskip("vllm.entrypoints.openai.responses.protocol")
responses_utils = pytest.importorskip("vllm.entrypoints.openai.responses.utils")

URLS = st.sampled_from(
    [{"url": "data:image/png;base64,QUJD"}, "https://m/a.png", {"url": "https://m/b"}, None, {}, [], 5, {"url": ""}]
)
VALUES = {
    "type": st.sampled_from([*chat_utils.MM_PARSER_MAP, "", None, "image", 1, "image_url "]),
    "uuid": st.sampled_from(["client-uuid", None, "", 0, {"a": 1}]),
    "image_url": URLS,
    "audio_url": URLS,
    "video_url": URLS,
    "input_audio": st.sampled_from([{"data": "AAAA", "format": "wav"}, "AAAA", None, {}]),
    "image_embeds": st.sampled_from([{"image_grid_thw": [1, 4, 4]}, None, "AAAA"]),
    "audio_embeds": st.sampled_from([{}, None]),
    "video_embeds": st.sampled_from([{}, None]),
    "prompt_embeds": st.sampled_from([{}, None]),
    "image_pil": st.none(),
    "text": st.sampled_from(["hi", None, 1]),
    "data": st.just("AAAA"),
    "tool_reference": st.just("t"),
    "name": st.just("t"),
    "thinking": st.just("hmm"),
    "refusal": st.just("no"),
    "detail": st.just("auto"),
}
parts = st.one_of(
    st.sampled_from(["a bare string", 3, None]),
    st.lists(st.sampled_from(sorted(VALUES)), min_size=1, max_size=4, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({key: VALUES[key] for key in keys})
    ),
)
bodies = st.lists(
    st.tuples(st.sampled_from(["user", "assistant", "system", "tool"]), st.lists(parts, min_size=1, max_size=3)),
    min_size=1,
    max_size=2,
).map(lambda ms: {"model": "m", "messages": [{"role": role, "content": content} for role, content in ms]})


def vllm_reads(body: dict) -> list[tuple[int, int, str, object]] | None:
    """(message, part, kind, uuid) as vLLM parses them; None where vLLM refuses the body."""
    try:
        request = protocol.ChatCompletionRequest.model_validate(json.loads(json.dumps(body)))
        seen = []
        for m, message in enumerate(request.messages):
            content = message.get("content")
            if content is None or isinstance(content, str):
                continue
            for p, part in enumerate(list(content)):
                if isinstance(part, str):
                    seen.append((m, p, "text", None))
                    continue
                kind, _ = chat_utils._parse_chat_message_content_mm_part(part)
                seen.append((m, p, kind, part.get("uuid")))
        return seen
    except Exception:  # vLLM answers 400 to anything its validation or parser refuses
        return None


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies)
def test_vllm_reads_every_forwarded_part_as_the_proxy_classified_it(body):
    try:
        normalised = normalise_request(body)
    except BadRequest:
        return
    items = normalised.items
    minted = {item.uuid for item in items}
    by_position = {(item.place.entry, item.place.part): item for item in items}
    forwarded = {
        "encoder": encoder_body(normalised.body, items, send_uuid=True),
        "encoder, no-rewrite": encoder_body(normalised.body, items, send_uuid=False),
        "consumer, no-rewrite": rewrite_request(normalised.body, items, Matches(), rewrite=False),
        "consumer, raw media": rewrite_request(normalised.body, items, Matches(), rewrite=True),
        "consumer, references": rewrite_request(
            normalised.body, items, every_item_matched(items, {"image_grid_thw": [[1, 4, 4]]}), rewrite=True
        ),
    }
    for name, sent in forwarded.items():
        for m, p, kind, uuid in vllm_reads(sent) or ():
            item = items[p] if name.startswith("encoder") else by_position.get((m, p))
            assert uuid is None or str(uuid) in minted, (name, body)
            if name == "consumer, references" and item is not None:
                assert kind.endswith("_embeds"), (name, body)
                continue
            assert kind not in REFERENCE_KINDS, (name, kind, body)
            if item is None:
                assert kind in TEXT_TYPES or kind == "tool_reference", (name, kind, body)
            else:
                assert kind == item.kind, (name, kind, item.kind, body)


# Responses parts: the SDK's part types (which vLLM's validation holds them to) with what a
# client may add beside, since the SDK's typed dicts keep unknown keys.
SDK_PARTS = st.sampled_from(
    [
        {"type": "input_text", "text": "hi"},
        {"type": "input_image", "image_url": "https://m/a.png", "detail": "auto"},
        {"type": "input_image", "image_url": "data:image/png;base64,QUJD", "detail": "auto"},
        {"type": "input_image", "detail": "auto"},
        {"type": "input_file", "file_data": "QUJD"},
        {"type": "output_text", "text": "ok", "annotations": []},
    ]
)
EXTRAS = st.dictionaries(
    st.sampled_from(["uuid", "image_url", "image_embeds", "audio_embeds", "image_pil", "video_url", "text"]),
    st.sampled_from([None, "client-uuid", "https://m/b.png", {"image_grid_thw": [1, 4, 4]}, {"url": "https://m/c"}]),
    max_size=2,
)
responses_parts = st.tuples(SDK_PARTS, EXTRAS).map(lambda pair: {**pair[0], **pair[1]})
responses_items = st.tuples(
    st.sampled_from(["user", "assistant", "system", "function_call_output", "custom_tool_call_output"]),
    st.lists(responses_parts, min_size=1, max_size=3),
).map(
    lambda pair: (
        {"role": pair[0], "content": pair[1]}
        if pair[0] in ("user", "assistant", "system")
        else {"type": pair[0], "call_id": "c", "output": pair[1]}
    )
)
responses_bodies = st.lists(responses_items, min_size=1, max_size=3).map(lambda items: {"model": "m", "input": items})


def vllm_reads_responses(body: dict) -> list[tuple[str, object]] | None:
    """(kind, uuid) of every part vLLM's chat parser reads of a Responses body; None where vLLM
    refuses the body."""
    try:
        request = responses_protocol.ResponsesRequest.model_validate(json.loads(json.dumps(body)))
        messages = responses_utils.construct_input_messages(request_input=request.input)
        seen = []
        for message in messages:
            content = message.get("content")
            if content is None or isinstance(content, str):
                continue
            for part in list(content):
                kind, _ = chat_utils._parse_chat_message_content_mm_part(part)
                seen.append((kind, part.get("uuid")))
        return seen
    except Exception:  # vLLM answers 400 to anything its validation, conversion or parser refuses
        return None


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=responses_bodies)
def test_vllm_reads_no_reference_and_no_client_uuid_in_what_the_responses_door_forwards(body):
    try:
        normalised = normalise_responses(body)
    except BadRequest:
        return
    items = normalised.items
    minted = {item.uuid for item in items}
    forwarded = {
        "consumer, no-rewrite": responses_consumer_body(
            normalised.body, items, Matches(), rewrite=False, push_mode=False
        ),
        "consumer": responses_consumer_body(normalised.body, items, Matches(), rewrite=True, push_mode=False),
    }
    for name, sent in forwarded.items():
        reads = vllm_reads_responses(sent)
        if reads is None:
            continue
        for kind, uuid in reads:
            assert kind not in REFERENCE_KINDS, (name, kind, body)
            assert uuid is None or str(uuid) in minted, (name, uuid, body)
        # Every image vLLM reads is one the proxy found, encoded and named.
        media = [kind for kind, _ in reads if kind not in TEXT_TYPES and kind != "tool_reference"]
        assert len(media) == len(items), (name, media, body)
    for _, p, kind, uuid in vllm_reads(encoder_body(normalised.body, items, send_uuid=True)) or ():
        assert kind == items[p].kind and uuid == items[p].uuid, body
