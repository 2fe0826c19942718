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


def test_an_entry_written_with_an_age_ages_from_then_and_never_replaces_a_newer_one():
    now = [0.0]
    recall: Recall[str, int] = Recall(4, 10.0, lambda: now[0])
    recall.put("seen", 1)
    now[0] = 5.0
    recall.put("seen", 2, age_s=8.0)  # seen elsewhere before this process saw it: kept as it was
    recall.put("old", 3, age_s=7.0)
    recall.put("too old", 4, age_s=11.0)
    assert recall.get("seen") == 1 and "too old" not in recall
    assert recall.ages() == [("seen", 5.0), ("old", 7.0)]
    now[0] = 8.5
    assert "old" not in recall and recall.ages() == [("seen", 8.5)]
