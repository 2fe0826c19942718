"""A bounded, ageing record (recall.py)."""

from __future__ import annotations

from epd_proxy.fleet.recall import Recall


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_least_recently_written_goes_first_when_full():
    recall: Recall[str, int] = Recall(2, 60.0, Clock())
    recall.put("a", 1)
    recall.put("b", 2)
    recall.put("a", 3)  # written again: now the newest
    recall.put("c", 4)
    assert (recall.get("a"), recall.get("b"), recall.get("c")) == (3, None, 4) and len(recall) == 2


def test_an_entry_is_forgotten_once_older_than_its_age_limit_and_reading_does_not_refresh_it():
    clock = Clock()
    recall: Recall[str, int] = Recall(8, 10.0, clock)
    recall.put("a", 1)
    clock.now = 9.0
    assert "a" in recall
    clock.now = 10.5
    assert recall.get("a") is None and "a" not in recall and len(recall) == 0
