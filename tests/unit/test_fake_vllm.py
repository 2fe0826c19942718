"""The fakes derive identifiers the way vLLM's processor does (ProcessorInputs.get_mm_hashes)."""

from __future__ import annotations

from epd_proxy.testing.fake_vllm import hash_factors, identifier


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
