"""Video and audio through the proxy against the fakes, where they hold vLLM 0.32's rules for these
modalities (read from its source and checked on the real engine in tests/e2e/test_e2e_media.py):
raw media and embeddings of one modality in one request are a 400, Qwen2-Audio's producer publishes
`audio_num_tokens`, and `videos_kwargs` is folded into a video's identifier only."""

from __future__ import annotations

import orjson

from tests.media import audio, chat, image, video

from .test_chat_epd import answer_of, direct_answer

WAV = "UklGRiQAAABXQVZFZm10IBAAAAABAAEAgD4AAAB9AAACABAAZGF0YQAAAAA="


def input_audio(data: str = WAV) -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


async def post(stack, url, body):
    async with stack.client.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.text()


async def test_the_fake_consumer_refuses_raw_media_mixed_with_embeddings_of_one_modality(make_stack):
    stack = await make_stack(encoders=1)
    for kind, part in (("image", image("A")), ("video", video("v")), ("audio", audio("s"))):
        uuid = f"{kind}-uuid"
        status, text = await post(stack, stack.backend_urls["e"][0], chat({**part, "uuid": uuid}))
        assert status == 200, text
        metadata = orjson.loads(text)["ec_transfer_params"][uuid]["metadata"]
        reference = {"type": f"{kind}_embeds", f"{kind}_embeds": {k: v[0] for k, v in metadata.items()}, "uuid": uuid}
        assert (await post(stack, stack.pd_url, chat(reference)))[0] == 200
        other = {**part, kind + "_url": {"url": "https://media.example/other"}}
        status, text = await post(stack, stack.pd_url, chat(reference, other))
        assert status == 400 and f"Mixing raw {kind} and embedding inputs is not allowed" in text, text
    # another modality raw beside the embeddings is fine
    status, text = await post(stack, stack.pd_url, chat(reference, image("B")))
    assert status == 200, text


async def test_an_image_without_metadata_keeps_every_image_raw_and_the_video_referenced(make_stack):
    # An encoder that reports one image without metadata: referencing the other image would mix raw
    # and embedded images, which vLLM answers 400 (the proxy did that before).
    b_url = image("B")["image_url"]["url"]
    stack = await make_stack(encoders=1, encoder_options={"no_metadata": frozenset({b_url})})
    body = chat(image("A"), video("v"), image("B"))
    got = await answer_of(stack, body)
    assert stack.pd.loaded_from_cache == 3 and stack.pd.encoded_locally == 0
    assert got == await direct_answer(stack, body)
    parts = stack.pd.requests[0].body["messages"][0]["content"][1:]
    assert [p["type"] for p in parts] == ["image_url", "video_embeds", "image_url"]
    assert all(p["uuid"] for p in parts)


async def test_audio_all_or_nothing_when_one_audio_item_has_no_metadata(make_stack):
    stack = await make_stack(encoders=2, encoder_options={"no_metadata": frozenset({WAV})})
    body = chat(audio("s"), input_audio(), image("A"))
    got = await answer_of(stack, body)
    # every item still names what its encoder stored, so nothing is encoded twice
    assert stack.pd.loaded_from_cache == 3 and stack.pd.encoded_locally == 0
    assert got == await direct_answer(stack, body)
    parts = stack.pd.requests[0].body["messages"][0]["content"][1:]
    assert [p["type"] for p in parts] == ["audio_url", "input_audio", "image_url"]
    # with metadata for all of them, all are references, audio_num_tokens as Qwen2-Audio publishes it
    stack = await make_stack(encoders=2)
    await answer_of(stack, body)
    parts = stack.pd.requests[0].body["messages"][0]["content"][1:]
    assert [p["type"] for p in parts] == ["audio_embeds", "audio_embeds", "image_embeds"]
    assert set(parts[0]["audio_embeds"]) == {"audio_num_tokens"}


async def test_video_processor_kwargs_scoped_to_video_leave_the_images_identifier_alone(make_stack):
    stack = await make_stack(encoders=1)
    body = chat(image("A"), video("v"), mm_processor_kwargs={"videos_kwargs": {"size": {"longest_edge": 6272}}})
    assert (await answer_of(stack, body)) == await direct_answer(stack, body)
    uuids = [p["uuid"] for p in stack.pd.requests[0].body["messages"][0]["content"][1:]]
    # the image is stored under the proxy's uuid itself, the video under a derived identifier
    assert uuids[0] in stack.store.entries and uuids[1] not in stack.store.entries
