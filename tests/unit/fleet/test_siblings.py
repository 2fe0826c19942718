"""siblings.py: the names one worker saw encoded reach the other workers of its port."""

from __future__ import annotations

import os
import socket

from epd_proxy.fleet.siblings import Siblings
from epd_proxy.journey.held import HeldMedia
from epd_proxy_tools.testing.polling import eventually

A, B = "a" * 32, "0123456789abcdef" * 2


class Other(Siblings):
    """A second worker in the same directory: another name, as another pid would give it."""

    def __init__(self, directory: str, name: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, name)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.bind(self.path)
        self._loop = None
        self.told = self.heard = self.dropped = 0


async def test_what_one_worker_saw_encoded_the_other_holds_and_nothing_else_gets_through(tmp_path):
    here, there = Siblings(str(tmp_path)), Other(str(tmp_path), "other.sock")
    record = HeldMedia()
    heard: list[list[str]] = []
    there.listen(lambda names: (heard.append(names), record.encoded_elsewhere(names)))
    mine = HeldMedia()
    mine.tell_encoded.append(here.tell)
    mine.encoded(iter([A, B]))
    await eventually(lambda: heard == [[A, B]], what="the sibling heard both names")
    assert here.told == 1 and there.heard == 2
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
