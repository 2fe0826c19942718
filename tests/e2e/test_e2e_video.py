"""Video through the proxy on real vLLM, E+PD (2 encoders + PD) and E+P+D (2 encoders + prefill +
decode), exact against a single plain vLLM instance: text, usage and logprobs.

The tiny Qwen2-VL model takes video as it is; the videos are small MP4s made offline with OpenCV.
A video is a sub-request of its own; images in the same request are batched. Each case also shows
the encoders did the work: the EC store entries written (named by the proxy's uuid, or derived from
it when options apply) and, in E+PD, PD's log of loading each one.

The negative control (options dropped on the encoder side) is last among the E+PD cases, as it can
kill PD's engine; conftest.py restarts PD for whatever runs after it.
"""

from __future__ import annotations

import hashlib

import pytest

from epd_proxy.journey.extract import content_uuid
from epd_proxy_tools.local.up import example_body

from .e2e_helpers import (
    LOWERCASE_IDS,
    MODEL,
    PREFILL,
    chat_ok,
    comparable,
    image_source,
    loaded_hashes,
    post_json,
    settled_encoder_total,
    store_entries,
    text_of,
)
from .media_helpers import EIGHT_FRAMES, SMALL_VIDEO, image_part, media_body, video_part, video_source
from .test_e2e_prefill import Watch, assert_handover, baseline_with_ids, media_keys, new_ec_entries

pytestmark = pytest.mark.e2e

# Seeds no other test draws: consumers keep embeddings and prefixes they have seen in memory.
fresh_video = video_source(range(40_000, 50_000))
fresh_image = image_source(range(50_000, 60_000))


def sha(url: str) -> str:
    """An image's name: the reference proxy's."""
    return hashlib.sha256(url.encode()).hexdigest()


def video_name(url: str) -> str:
    """A video's name: its bytes under the video kind's tag, never the same bytes' image name."""
    return content_uuid(video_part(url), "video_url")


def new_entries(st, before: dict[str, bool]) -> dict[str, bool]:
    return {h: ok for h, ok in store_entries(st.ec_store).items() if h not in before}


# ---------------------------------------------------------------- E+PD
def test_video_baseline_is_sensitive_to_video_and_options(stack):
    """Exact matching proves something only if the answer depends on the video and the options."""
    base = stack.baseline_url
    a, b = fresh_video(2)
    ans = {
        "A": chat_ok(base, media_body([video_part(a)])),
        "B": chat_ok(base, media_body([video_part(b)])),
        "A 8 frames": chat_ok(base, media_body([video_part(a)], media_io_kwargs=EIGHT_FRAMES)),
        "A small": chat_ok(base, media_body([video_part(a)], mm_processor_kwargs=SMALL_VIDEO)),
        "text": chat_ok(base, media_body([])),
    }
    for x, y in [("A", "B"), ("A", "A 8 frames"), ("A", "A small"), ("A", "text")]:
        assert text_of(ans[x]) != text_of(ans[y]), f"baseline answers {x!r} and {y!r} are both {text_of(ans[x])!r}"
    tokens = {k: v["usage"]["prompt_tokens"] for k, v in ans.items()}
    # 4 frames of 8x8 patches (32 tokens); 8 frames (64); a 4x4 grid (8)
    assert tokens["A 8 frames"] - tokens["A"] == 32 and tokens["A"] - tokens["A small"] == 24, tokens


def test_one_video(stack, fidelity):
    (v,) = fresh_video(1)
    before_store = store_entries(stack.ec_store)
    before_enc = settled_encoder_total(stack.encoder_urls)
    body = media_body([video_part(v)], logprobs=True, top_logprobs=3)
    got = chat_ok(stack.proxy_url, body)
    fidelity.check("one video", got, chat_ok(stack.baseline_url, body))
    assert settled_encoder_total(stack.encoder_urls, before_enc + 1) == before_enc + 1
    new = new_entries(stack, before_store)
    assert new == {video_name(v): True}, new
    assert video_name(v) in loaded_hashes(stack.log_path("pd")), "PD did not load E's video embedding"


def test_video_between_two_images(stack, fidelity):
    """The video is a sub-request of its own, the two images one sub-request on the other encoder."""
    a, b = fresh_image(2)
    (v,) = fresh_video(1)
    before_store = store_entries(stack.ec_store)
    before_enc = settled_encoder_total(stack.encoder_urls)
    body = media_body([image_part(a), video_part(v), image_part(b)], logprobs=True, top_logprobs=2)
    got = chat_ok(stack.proxy_url, body)
    after_enc = settled_encoder_total(stack.encoder_urls, before_enc + 2)
    fidelity.check("image, video, image", got, chat_ok(stack.baseline_url, body))
    assert after_enc - before_enc == 2
    new = new_entries(stack, before_store)
    assert new == {sha(a): True, video_name(v): True, sha(b): True}, new
    assert set(new) <= set(loaded_hashes(stack.log_path("pd")))


def test_same_video_twice(stack, fidelity):
    (v,) = fresh_video(1)
    before_store = store_entries(stack.ec_store)
    before_enc = settled_encoder_total(stack.encoder_urls)
    body = media_body([video_part(v), video_part(v)], logprobs=True, top_logprobs=2)
    got = chat_ok(stack.proxy_url, body)
    after_enc = settled_encoder_total(stack.encoder_urls, before_enc + 2)
    want = chat_ok(stack.baseline_url, body)
    fidelity.check("the same video twice", got, want)
    # one sub-request per occurrence, one stored embedding, both placeholders filled from it
    assert after_enc - before_enc == 2
    assert new_entries(stack, before_store) == {video_name(v): True}
    assert (
        want["usage"]["prompt_tokens"]
        > chat_ok(stack.baseline_url, media_body([video_part(v)]))["usage"]["prompt_tokens"]
    )


def test_video_options_reach_the_encoders(stack, fidelity):
    """Non-default frame sampling (`media_io_kwargs.video`) and a video-only processor option
    (`mm_processor_kwargs.videos_kwargs`) next to an image: the video's entry is derived from the
    uuid and both options, the image's stays the bare uuid (vLLM scopes both to the video)."""
    (a,) = fresh_image(1)
    (v,) = fresh_video(1)
    before_store = store_entries(stack.ec_store)
    opts = dict(media_io_kwargs=EIGHT_FRAMES, mm_processor_kwargs=SMALL_VIDEO)
    body = media_body([image_part(a), video_part(v)], logprobs=True, top_logprobs=2, **opts)
    got = chat_ok(stack.proxy_url, body)
    want = chat_ok(stack.baseline_url, body)
    fidelity.check("image + video, 8 frames + videos_kwargs size", got, want)
    default = chat_ok(stack.baseline_url, media_body([image_part(a), video_part(v)]))
    # 8 frames of a 4x4 grid (16 tokens) instead of 4 frames of 8x8 (32)
    assert default["usage"]["prompt_tokens"] - got["usage"]["prompt_tokens"] == 16
    new = new_entries(stack, before_store)
    assert len(new) == 2 and all(new.values()) and sha(a) in new and video_name(v) not in new, new
    assert set(new) <= set(loaded_hashes(stack.log_path("pd")))


def test_up_video_example_request_is_answered(stack):
    """The request `epd-proxy up --model-kind video` writes works against the real stack."""
    body = example_body("video", stack.model_name)
    got = text_of(chat_ok(stack.proxy_url, body))
    # Noise from random weights, but at temperature 0 the same noise every time.
    assert got and text_of(chat_ok(stack.proxy_url, body)) == got


def test_zz_video_negative_control_options_not_forwarded(stack):
    """Options dropped on the way to the encoder must fail: E stores the video under the bare uuid
    with the default grid, PD (given the options) derives another identifier and finds nothing."""
    (v,) = fresh_video(1)
    opts = dict(media_io_kwargs=EIGHT_FRAMES, mm_processor_kwargs=SMALL_VIDEO)
    want = chat_ok(stack.baseline_url, media_body([video_part(v)], **opts))
    uuid = sha(v)
    enc = chat_ok(
        stack.encoder_urls[0],
        {"model": MODEL, "messages": [{"role": "user", "content": [{**video_part(v), "uuid": uuid}]}], "stream": False},
    )
    params = enc.get("ec_transfer_params") or {}
    assert list(params) == [uuid], params
    grid = params[uuid]["metadata"]["video_grid_thw"]
    pd_body = media_body([{"type": "video_embeds", "video_embeds": {"video_grid_thw": grid}, "uuid": uuid}], **opts)
    pd_body["allowed_token_ids"] = LOWERCASE_IDS
    status, data = post_json(stack.pd_url, pd_body, timeout=60)
    if status == 200:
        assert comparable(data) != comparable(want), "a stale video embedding produced the right answer?"
    else:
        assert status >= 500, f"unexpected HTTP {status}: {data}"


# ---------------------------------------------------------------- E+P+D
def test_prefill_one_video(prefill_stack, fidelity):
    st = prefill_stack
    (v,) = fresh_video(1)
    ec_before = store_entries(st.ec_store)
    watch = Watch(st)
    body = media_body([video_part(v)], text="Describe the clip.", logprobs=True, top_logprobs=3)
    got = chat_ok(st.proxy_url, body)
    h = watch.after()
    want = baseline_with_ids(st, body)
    fidelity.check("one video", got, want, path=PREFILL, kv=h.describe(want["usage"]["prompt_tokens"]))
    new_ec = new_ec_entries(st, ec_before)
    assert new_ec == [video_name(v)], new_ec
    assert_handover(st, h, want, media_keys("V", new_ec))


def test_prefill_images_and_video_with_options(prefill_stack, fidelity):
    st = prefill_stack
    a, b = fresh_image(2)
    (v,) = fresh_video(1)
    ec_before = store_entries(st.ec_store)
    enc_before = settled_encoder_total(st.encoder_urls)
    watch = Watch(st)
    opts = dict(media_io_kwargs=EIGHT_FRAMES, mm_processor_kwargs=SMALL_VIDEO)
    body = media_body([image_part(a), video_part(v), image_part(b)], logprobs=True, top_logprobs=2, **opts)
    got = chat_ok(st.proxy_url, body)
    h = watch.after()
    want = baseline_with_ids(st, body)
    fidelity.check(
        "image, video, image, 8 frames + videos_kwargs size",
        got,
        want,
        path=PREFILL,
        kv=h.describe(want["usage"]["prompt_tokens"]),
    )
    assert settled_encoder_total(st.encoder_urls, enc_before + 2) - enc_before == 2
    new_ec = new_ec_entries(st, ec_before)
    assert len(new_ec) == 3 and sha(a) in new_ec and sha(b) in new_ec and video_name(v) not in new_ec, new_ec
    assert_handover(st, h, want, media_keys("AVB", new_ec))
