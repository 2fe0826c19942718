"""The fakes derive identifiers the way vLLM's processor does (ProcessorInputs.get_mm_hashes), and
charge the benchmark's encoder costs: fixed plus per image, cached repeats, slower encoders."""

from __future__ import annotations

import asyncio
import dataclasses

import orjson
import pytest

from epd_proxy_tools.testing.fake_vllm import Costs, ECStore, FakeVLLM, hash_factors, identifier


def test_media_io_kwargs_of_the_items_modality_derive_the_identifier():
    body = {"media_io_kwargs": {"image": {"mode": "RGB"}}}
    factors = hash_factors("image", body)
    assert factors == {"media_io_kwargs": {"image": {"mode": "RGB"}}}
    assert identifier("u", "media", factors) != "u"
    # another modality's options do not touch an image's identifier
    assert hash_factors("image", {"media_io_kwargs": {"video": {"num_frames": 4}}}) == {}
    assert identifier("u", "media", {}) == "u"


def test_processor_kwargs_and_media_io_kwargs_both_count():
    body = {"mm_processor_kwargs": {"size": 1}, "media_io_kwargs": {"image": {"mode": "L"}}}
    one = identifier("u", "m", hash_factors("image", body))
    other = identifier("u", "m", hash_factors("image", {**body, "media_io_kwargs": {"image": {"mode": "RGB"}}}))
    assert one != other


def test_processor_kwargs_scoped_to_another_modality_leave_the_identifier_alone():
    # vLLM 0.32: `videos_kwargs` is folded into a video's identifier only; an image sent with it
    # keeps its bare uuid (seen on the real encoder: the image entry stays under the uuid).
    body = {"mm_processor_kwargs": {"videos_kwargs": {"size": {"longest_edge": 6272}}}}
    assert hash_factors("image", body) == {}
    assert hash_factors("video", body) == {"mm_processor_kwargs": body["mm_processor_kwargs"]}
    assert hash_factors("image", {"mm_processor_kwargs": {"size": 1, "videos_kwargs": {}}}) == {
        "mm_processor_kwargs": {"size": 1}
    }


class _Exchange:
    """The little of a request the fake encoder reads."""

    def __init__(self, body: dict) -> None:
        self.method, self.path, self.headers = "POST", "/v1/chat/completions", {"x-request-id": "m-1"}
        self.body = orjson.dumps(body)
        self.gone = False


async def _charged(fake: FakeVLLM, names: str) -> float:
    """Seconds of encoder time one sub-request holding images `names` costs."""
    content = [{"type": "image_url", "image_url": {"url": f"https://m/{n}.png"}, "uuid": n} for n in names]
    loop = asyncio.get_running_loop()
    before = max(loop.time(), fake._free_at)
    answer = await fake.chat(_Exchange({"model": "m", "messages": [{"role": "user", "content": content}]}))
    assert answer.status == 200
    return fake._free_at - before


COSTS = Costs(request_s=0.01, image_s=0.03, repeat_factor=0.4, cache_items=3)


async def test_a_sub_request_costs_a_fixed_part_plus_each_image_and_repeats_less_where_seen():
    fake = FakeVLLM("encode", ECStore(), costs=COSTS)
    assert await _charged(fake, "AB") == pytest.approx(0.01 + 2 * 0.03, abs=2e-3)
    assert await _charged(fake, "AB") == pytest.approx(0.01 + 2 * 0.4 * 0.03, abs=2e-3)
    assert await _charged(fake, "CA") == pytest.approx(0.01 + 0.03 + 0.4 * 0.03, abs=2e-3)
    # Only the last three images stay: D pushes B out (A and C were used after it).
    assert await _charged(fake, "D") == pytest.approx(0.04, abs=2e-3)
    assert await _charged(fake, "B") == pytest.approx(0.04, abs=2e-3)
    assert (fake.cache.hits, fake.cache.misses) == (3, 5)
    # Another encoder has seen none of them.
    assert await _charged(FakeVLLM("encode", ECStore(), costs=COSTS), "A") == pytest.approx(0.04, abs=2e-3)


async def test_a_slower_encoder_costs_its_factor_on_everything():
    slow = FakeVLLM("encode", ECStore(), costs=dataclasses.replace(COSTS, slowdown=3.0))
    assert await _charged(slow, "AB") == pytest.approx(3 * (0.01 + 2 * 0.03), abs=3e-3)
    assert await _charged(slow, "A") == pytest.approx(3 * (0.01 + 0.4 * 0.03), abs=3e-3)


def test_the_bench_passes_speeds_and_repeats_to_its_fakes():
    from epd_proxy_tools.bench.runner import encoder_speeds, parse_args

    assert encoder_speeds(parse_args(["--encoder-speeds", "1,1,1,3"])) == [1.0, 1.0, 1.0, 3.0]
    assert encoder_speeds(parse_args([])) == [1.0] * 4
    for bad in ("1,2", "1,1,1,0", "1,a,1,1"):
        with pytest.raises(SystemExit):
            encoder_speeds(parse_args(["--encoder-speeds", bad]))
    args = parse_args(["--encoder-repeat-factor", "0.4", "--encoder-cache-items", "64"])
    assert (args.encoder_repeat_factor, args.encoder_cache_items) == (0.4, 64)


def _turn(*names: str, embeds: bool = False) -> dict:
    """One conversation's body with an image per user turn, as raw media or as references."""
    messages = []
    for n, name in enumerate(names):
        if n:
            messages.append({"role": "assistant", "content": "ok"})
        part = (
            {"type": "image_embeds", "image_embeds": {"image_grid_thw": None}, "uuid": name}
            if embeds
            else {"type": "image_url", "image_url": {"url": f"https://m/{name}.png"}, "uuid": name}
        )
        messages.append({"role": "user", "content": [{"type": "text", "text": f"step {n}"}, part]})
    return {"model": "m", "messages": messages, "max_tokens": 4}


async def test_a_consumer_needs_nothing_for_raw_media_inside_its_prefix_loads_the_rest_or_encodes_it():
    store = ECStore()
    pd = FakeVLLM("pd", store)
    assert (await pd.chat(_Exchange(_turn("a")))).status == 200
    assert (pd.counts.local_encodes["m"], pd.counts.cached_tokens["m"]) == (1, 0)
    # An encoder stored b: the next turn has a inside the cached prefix and loads b.
    await FakeVLLM("encode", store).chat(_Exchange({"model": "m", "messages": [_turn("b")["messages"][0]]}))
    assert (await pd.chat(_Exchange(_turn("a", "b")))).status == 200
    assert (pd.counts.prefix_items["m"], pd.counts.ec_loads["m"], pd.counts.local_encodes["m"]) == (1, 1, 1)
    assert 0 < pd.counts.cached_tokens["m"] < pd.counts.prompt_tokens["m"]
    # Another instance holds no prefix: it loads b and encodes a itself.
    other = FakeVLLM("pd", store)
    assert (await other.chat(_Exchange(_turn("a", "b")))).status == 200
    assert (other.counts.prefix_items["m"], other.counts.ec_loads["m"], other.counts.local_encodes["m"]) == (0, 1, 1)


async def test_a_text_only_consumer_refuses_raw_media_as_vllm_does_and_takes_references():
    store = ECStore()
    await FakeVLLM("encode", store).chat(_Exchange({"model": "m", "messages": [_turn("a")["messages"][0]]}))
    pd = FakeVLLM("pd", store, text_only=True)
    refused = await pd.chat(_Exchange(_turn("a")))
    assert refused.status == 400
    assert orjson.loads(refused.body)["error"]["message"] == "At most 0 image(s) may be provided in one prompt."
    _, shape = store.entries["a"]
    reference = _turn("a", embeds=True)
    reference["messages"][0]["content"][1]["image_embeds"]["image_grid_thw"] = shape
    assert (await pd.chat(_Exchange(reference))).status == 200


async def test_items_are_counted_against_the_limits_before_any_is_loaded_as_vllm_does():
    unloadable = {"type": "image_url", "image_url": {"url": "data:no-comma"}}
    video = {"type": "video_url", "video_url": {"url": "https://m/v.mp4"}}
    body = {"model": "m", "messages": [{"role": "user", "content": [unloadable, video]}]}
    pd = FakeVLLM("pd", ECStore(), no_raw=frozenset({"video"}))
    refused = await pd.chat(_Exchange(body))
    assert refused.status == 400
    assert orjson.loads(refused.body)["error"]["message"] == "At most 0 video(s) may be provided in one prompt."
    unlimited = await FakeVLLM("pd", ECStore()).chat(_Exchange(body))
    assert unlimited.status == 400
    assert orjson.loads(unlimited.body)["error"]["message"].startswith("Invalid data URL 'data:no-comma'")


async def test_a_cache_salt_keeps_a_prompt_out_of_another_salts_prefix_as_vllm_does():
    """vLLM folds `cache_salt` into the first block's hash only (kv_cache_utils.py), and every
    later block chains on it: the same prompt under two salts shares nothing."""
    pd = FakeVLLM("pd", ECStore())
    for salt in (None, "tenant-a", "tenant-a", "tenant-b"):
        body = _turn("a") if salt is None else {**_turn("a"), "cache_salt": salt}
        assert (await pd.chat(_Exchange(body))).status == 200
    # Only the second "tenant-a" request found its prefix (the whole prompt) cached.
    assert pd.counts.prefix_items["m"] == 1
    assert pd.counts.cached_tokens["m"] == pd.counts.prompt_tokens["m"] // 4


@pytest.mark.parametrize("salt", ["", 7, "a/b", "x" * 129])
async def test_a_cache_salt_vllm_refuses_is_a_400(salt):
    answer = await FakeVLLM("pd", ECStore()).chat(_Exchange({**_turn("a"), "cache_salt": salt}))
    assert answer.status == 400
    assert "cache_salt" in orjson.loads(answer.body)["error"]["message"]
