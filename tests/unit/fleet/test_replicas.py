"""replicas.py without a store: the messages replicas exchange, and what is dropped unsent. Over a
real redis-server between proxy processes: tests/http/test_roster.py."""

from __future__ import annotations

from epd_proxy.fleet.replicas import DROPPED, PENDING_NAMES, ReplicaChannel, encoded_message, names_from

A, B = "a" * 32, "0123456789abcdef" * 2


def test_a_replica_hears_the_others_names_and_never_its_own():
    mine, theirs = b"me", b"them"
    assert names_from(encoded_message(theirs, [A, B]), mine) == [A, B]
    assert names_from(encoded_message(mine, [A, B]), mine) == []


def test_only_names_of_the_proxys_own_form_are_taken_from_a_message():
    assert names_from(b"them\n" + b"\n".join([b"not-a-name", A.upper().encode(), A.encode()]), b"me") == [A]
    assert names_from(b"them", b"me") == []  # a sender and nothing else
    assert names_from(b"", b"me") == []  # a pong
    assert names_from(None, b"me") == []  # a message of another kind


async def test_names_queued_past_the_bound_are_counted_dropped_and_telling_never_waits():
    counted: dict[str, int] = {}
    # No store listens there: nothing is sent until start(), which this test never calls.
    record = ReplicaChannel(
        "redis://127.0.0.1:1/0", lambda names: None, lambda what, n: counted.update({what: counted.get(what, 0) + n})
    )
    record.tell([A] * (PENDING_NAMES - 1))
    assert counted == {}
    record.tell([B] * 3)
    assert counted == {DROPPED: 2}
    await record.close()
