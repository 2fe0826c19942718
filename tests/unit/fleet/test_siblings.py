"""siblings.py: the names one worker saw encoded reach the other workers of its port."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from epd_proxy.fleet import siblings
from epd_proxy.fleet.siblings import Siblings
from epd_proxy.journey.held import HELD_TTL_S, HeldMedia
from epd_proxy_tools.testing.polling import eventually

A, B = "a" * 32, "0123456789abcdef" * 2


async def test_what_one_worker_saw_encoded_the_other_holds_and_nothing_else_gets_through(tmp_path):
    here, mine = Siblings(str(tmp_path)), HeldMedia()
    await here.listen(mine)
    there = Siblings(str(tmp_path), "other.sock")
    heard: list[list[str]] = []

    class Heard(HeldMedia):
        def encoded_elsewhere(self, names):
            heard.append(list(names))
            super().encoded_elsewhere(names)

    await there.listen(Heard())
    mine.tell_encoded.append(here.tell)
    mine.encoded(iter([A, B]))
    await eventually(lambda: heard == [[A, B]], what="the sibling heard both names")
    assert there.heard == 2
    # Only names of the proxy's own form are taken from a datagram.
    here.tell(["not-a-name", "A" * 32])
    here.tell([A])
    await eventually(lambda: len(heard) == 2, what="the next datagram")
    assert heard[1] == [A]
    here.close()
    there.close()
    assert os.listdir(tmp_path) == []


async def test_a_dead_workers_socket_is_cleared_and_a_lone_worker_tells_no_one(tmp_path):
    here = Siblings(str(tmp_path))
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    gone.bind(str(tmp_path / "999999.sock"))
    gone.close()  # its file stays, nobody reads it
    here.tell([A])
    assert os.listdir(tmp_path) == [os.path.basename(here.path)]
    here.tell([A])
    assert here.told == 0 and here.dropped == 0
    here.close()
    assert Siblings.join(None) is None and Siblings.join("") is None
    assert Siblings.join(str(tmp_path / "missing")) is None  # logged: each worker keeps its own record


async def test_a_worker_that_starts_later_gets_what_the_others_saw_encoded_and_when(tmp_path):
    clock = [100.0]
    early_record = HeldMedia(clock=lambda: clock[0])
    early = Siblings(str(tmp_path), "early.sock")
    await early.listen(early_record)
    early_record.tell_encoded.append(early.tell)
    early_record.encoded([A])
    clock[0] += 60.0
    many = [f"{n:032x}" for n in range(2500)]  # three datagrams
    early_record.encoded([B, *many])  # told to no one: the late worker is not bound yet
    late_record = HeldMedia(clock=lambda: clock[0])
    late = Siblings(str(tmp_path), "late.sock")
    await late.listen(late_record)
    assert len(late_record.encoded_record()) == 2502, "the early worker's whole record, before the late one serves"
    ages = dict(late_record.encoded_record())
    assert ages[A] == pytest.approx(60.0, abs=0.01) and ages[B] == pytest.approx(0.0, abs=0.01)
    # Replayed names age from when they were seen, not from the replay.
    clock[0] += HELD_TTL_S - 30.0
    assert [name for name, _ in late_record.encoded_record()][:1] == [B]
    assert A not in dict(late_record.encoded_record())
    # What a worker tells from now on reaches the late one as before.
    late_record.tell_encoded.append(late.tell)
    late_record.encoded(["c" * 32])
    await eventually(lambda: "c" * 32 in dict(early_record.encoded_record()), what="told back")
    early.close()
    late.close()


async def test_a_sibling_that_never_reads_costs_one_answer_and_holds_up_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(siblings, "REPLAY_DEADLINE_S", 0.2)
    record = HeldMedia()
    record.encoded([f"{n:032x}" for n in range(65536)])
    here = Siblings(str(tmp_path), "here.sock")
    await here.listen(record)
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # a worker that stopped reading
    hung.bind(str(tmp_path / "hung.sock"))
    hung.sendto(siblings.ASK, here.path)
    await eventually(lambda: here.dropped == 1 and not here._answers, what="the answer given up")
    # A worker starting now asks both: it serves once the first whole answer came, not after the
    # hung one's silence, and what it is told since reaches it past the hung worker's full queue.
    late_record = HeldMedia()
    late = Siblings(str(tmp_path), "late.sock")
    await asyncio.wait_for(late.listen(late_record, catch_up_s=60.0), timeout=30.0)
    assert len(late_record.encoded_record()) == 65536
    record.tell_encoded.append(here.tell)
    record.encoded(["c" * 32])
    await eventually(lambda: "c" * 32 in dict(late_record.encoded_record()), what="told past the hung worker")
    late.close()
    here.close()
    # With only a silent sibling, a starting worker serves after its wait.
    alone = Siblings(str(tmp_path), "alone.sock")
    await asyncio.wait_for(alone.listen(HeldMedia(), catch_up_s=0.2), timeout=30.0)
    alone.close()
    hung.close()
