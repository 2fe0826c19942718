"""What one media item costs an encoder (cost.py), and the overdue time that follows from it."""

from __future__ import annotations

import pytest

from epd_proxy.fleet.cost import MAX_COST, MIN_COST, VIDEO_DEFAULT_FRAMES, request_costs
from epd_proxy.fleet.lanes import Lane
from epd_proxy.fleet.stalls import OVERDUE_FACTOR, overdue_after
from epd_proxy.journey.extract import normalise_request
from tests.media import audio, chat, image, video


def costs(**fields):
    return request_costs(chat(**fields))


def test_an_image_is_the_unit_and_a_video_costs_its_frames():
    plain = costs()
    assert plain["image_url"] == 1.0
    assert plain["audio_url"] == plain["input_audio"] == 1.0
    # vLLM samples 32 frames of a video unless told otherwise: many images' worth.
    assert plain["video_url"] > 8 * plain["image_url"]
    few = costs(media_io_kwargs={"video": {"num_frames": 4}})["video_url"]
    many = costs(media_io_kwargs={"video": {"num_frames": 128}})["video_url"]
    assert few < plain["video_url"] < many
    assert many == pytest.approx(plain["video_url"] * 128 / VIDEO_DEFAULT_FRAMES)
    # A processor that samples frames itself bounds them too: the smaller bound wins.
    assert costs(mm_processor_kwargs={"num_frames": 4}, media_io_kwargs={"video": {"num_frames": 64}})[
        "video_url"
    ] == pytest.approx(few)


def test_a_pixel_cap_below_a_typical_photo_makes_images_and_frames_cheaper():
    capped = costs(mm_processor_kwargs={"max_pixels": 256 * 256})
    assert capped["image_url"] < 0.1
    assert capped["video_url"] < costs()["video_url"]
    # The Hugging Face spelling of the same cap.
    assert costs(mm_processor_kwargs={"size": {"longest_edge": 256 * 256}})["image_url"] == capped["image_url"]
    # A cap above a typical photo says nothing of the image itself: still one unit.
    assert costs(mm_processor_kwargs={"max_pixels": 10**8})["image_url"] == 1.0


@pytest.mark.parametrize(
    "fields",
    [
        {"mm_processor_kwargs": "junk"},
        {"mm_processor_kwargs": {"max_pixels": True, "num_frames": "many"}},
        {"media_io_kwargs": {"video": {"num_frames": 10**12}}},
        {"media_io_kwargs": {"video": {"num_frames": -1}}},
        {"media_io_kwargs": {"video": {"num_frames": 0.5}}},
        {"mm_processor_kwargs": {"max_pixels": 1}},
        {"media_io_kwargs": ["video"]},
    ],
)
def test_whatever_a_client_writes_the_cost_stays_within_bounds(fields):
    for cost in costs(**fields).values():
        assert MIN_COST <= cost <= MAX_COST


def test_every_media_item_carries_its_cost_from_the_request():
    body = chat(image("a"), video("v"), audio("s"), media_io_kwargs={"video": {"num_frames": 64}})
    items = normalise_request(body).items
    assert [item.cost for item in items] == [request_costs(body)[item.kind] for item in items]
    assert items[1].cost > items[0].cost


def test_a_video_with_many_frames_is_overdue_much_later_than_one_image():
    lane = Lane("e")
    lane.started(1.0, 0.0)
    lane.finished(1.0, 0.0, 2.0)  # slow: 2 s for an image
    one_image = overdue_after(lane, 1.0, None)
    lane.started(10.0, 10.0)
    a_video = overdue_after(lane, costs(media_io_kwargs={"video": {"num_frames": 128}})["video_url"], None)
    assert a_video > 10 * one_image
    assert a_video == pytest.approx(
        OVERDUE_FACTOR * (lane.speed.fixed_s * lane.work.inflight + lane.speed.item_s * 64.0)
    )


def test_each_move_doubles_an_items_overdue_time_up_to_a_share_of_the_encode_timeout():
    lane = Lane("e")
    lane.started(1.0, 0.0)
    lane.finished(1.0, 0.0, 0.01)
    first = overdue_after(lane, 1.0, 300.0)
    assert overdue_after(lane, 1.0, 300.0, moves=1) == 2 * first
    assert overdue_after(lane, 1.0, 300.0, moves=2) == 4 * first
    assert overdue_after(lane, 1.0, 300.0, moves=10) == 0.75 * 300.0
