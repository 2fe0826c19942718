"""replicas.py without a store: the messages replicas exchange, and what is dropped unsent. Over a
real redis-server between proxy processes: tests/http/test_roster.py."""

from __future__ import annotations

from epd_proxy.fleet.replicas import DROPPED, PENDING_NAMES, ReplicaRecord, heard, message

A, B = "a" * 32, "0123456789abcdef" * 2


def test_a_replica_hears_the_others_names_and_never_its_own():
    mine, theirs = b"me", b"them"
    assert heard(message(theirs, [A, B]), mine) == [A, B]
    assert heard(message(mine, [A, B]), mine) == []


def test_only_names_of_the_proxys_own_form_are_taken_from_a_message():
    assert heard(b"them\n" + b"\n".join([b"not-a-name", A.upper().encode(), A.encode()]), b"me") == [A]
    assert heard(b"them", b"me") == []  # a sender and nothing else
    assert heard("a text, not bytes", b"me") == []  # a pong, or a message of another kind
    assert heard(None, b"me") == []


async def test_names_queued_past_the_bound_are_counted_dropped_and_telling_never_waits():
    counted: dict[str, int] = {}
    # No store listens there: nothing is sent until start(), which this test never calls.
    record = ReplicaRecord(
        "redis://127.0.0.1:1/0", lambda names: None, lambda what, n: counted.update({what: counted.get(what, 0) + n})
    )
    record.tell([A] * (PENDING_NAMES - 1))
    assert counted == {}
    record.tell([B] * 3)
    assert counted == {DROPPED: 2}
    await record.close()
