"""What one media item costs an encoder, in image-equivalents: the unit in which the lanes
measure each encoder's speed and outstanding work (lanes.py), placement weighs items
(scheduler.py), and a sub-request's overdue time is set. Pure.

The proxy does not decode media, so the cost is what the request's own options tell: the kind
of item, for a video the frames vLLM samples from it (`media_io_kwargs.video.num_frames`, 32 by
default in vLLM's `VideoMediaIO`, or a processor's `num_frames`), and a pixel cap
(`mm_processor_kwargs.max_pixels`, or `size.longest_edge`) below a typical photo. Whatever a
client writes there, the cost stays within [MIN_COST, MAX_COST]: a false claim can only skew
timing estimates, and only while its own sub-request is outstanding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# A typical photo after the vision processor's resize: a pixel cap at or above it says nothing
# about the image, one below it makes the item that much cheaper.
TYPICAL_PIXELS = 1024 * 1024
# vLLM samples this many frames of a video unless the request says otherwise (VideoMediaIO).
VIDEO_DEFAULT_FRAMES = 32
# `num_frames: -1` asks for every frame: the proxy cannot count them, so it takes this many,
# which also bounds any count a client writes.
VIDEO_MAX_FRAMES = 256
# A frame costs about half an image: Qwen-VL style towers fold two frames into one temporal patch.
FRAME_COST = 0.5
AUDIO_COST = 1.0
MIN_COST = 1 / 16
MAX_COST = VIDEO_MAX_FRAMES * FRAME_COST

IMAGE_KINDS = ("image_url",)
AUDIO_KINDS = ("audio_url", "input_audio")
VIDEO_KINDS = ("video_url",)


def request_costs(body: Mapping[str, Any]) -> dict[str, float]:
    """Each media kind's cost under this request's options (they apply to all of its items)."""
    processor = _mapping(body.get("mm_processor_kwargs"))
    video_io = _mapping(_mapping(body.get("media_io_kwargs")).get("video"))
    pixels = _pixel_scale(processor)
    frames = _frames(video_io.get("num_frames"), processor.get("num_frames"))
    costs = dict.fromkeys(IMAGE_KINDS, _bounded(pixels))
    costs.update(dict.fromkeys(AUDIO_KINDS, AUDIO_COST))
    costs.update(dict.fromkeys(VIDEO_KINDS, _bounded(frames * FRAME_COST * pixels)))
    return costs


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _number(value: Any) -> float | None:
    # bool is an int to Python, not to a client who wrote `true`.
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _pixel_scale(processor: Mapping[str, Any]) -> float:
    cap = _number(processor.get("max_pixels"))
    if cap is None:
        cap = _number(_mapping(processor.get("size")).get("longest_edge"))
    if cap is None or cap <= 0:
        return 1.0
    return min(1.0, cap / TYPICAL_PIXELS)


def _frames(*counts: Any) -> float:
    """The frames sampled: the smallest count given (each bounds them), all frames for -1."""
    given = [n for n in map(_number, counts) if n is not None and (n >= 1 or n == -1)]
    bounds = [VIDEO_MAX_FRAMES if n == -1 else min(n, VIDEO_MAX_FRAMES) for n in given]
    return min(bounds) if bounds else VIDEO_DEFAULT_FRAMES


def _bounded(cost: float) -> float:
    return min(MAX_COST, max(MIN_COST, cost))
