from __future__ import annotations

import pytest

from epd_proxy.journey.extract import normalise_request
from epd_proxy.journey.plan import plan_groups
from tests.media import audio, chat, image, video


def items_of(*parts):
    return normalise_request(chat(*parts)).items


AACDAF = [image(n) for n in "AACDAF"]


@pytest.mark.parametrize(
    "cap, sizes, groups",
    [
        (0, [3, 3], [(0, (0, 2, 4)), (1, (1, 3, 5))]),
        (1, [1] * 6, [(k % 2, (k,)) for k in range(6)]),
        (2, [2, 2, 1, 1], [(0, (0, 2)), (1, (1, 3)), (0, (4,)), (1, (5,))]),
    ],
)
def test_images_group_per_encoder_up_to_the_cap(cap, sizes, groups):
    items = items_of(*AACDAF)
    plan = plan_groups(items, [k % 2 for k in range(6)], cap)
    assert [len(g.indices) for g in plan] == sizes
    assert [(g.encoder, g.indices) for g in plan] == groups


def test_audio_and_video_are_always_single():
    items = items_of(image("A"), audio("x"), image("B"), video("v"), image("C"))
    plan = plan_groups(items, [0, 0, 0, 0, 0], 0)
    assert [(g.encoder, g.indices) for g in plan] == [(0, (0, 2, 4)), (0, (1,)), (0, (3,))]


def test_plan_requires_one_choice_per_item():
    with pytest.raises(ValueError):
        plan_groups(items_of(image("A")), [], 0)
