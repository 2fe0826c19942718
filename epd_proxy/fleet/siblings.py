"""`serve --workers`: what one worker saw encoded, told to the others of the same port.

The kernel spreads a conversation's turns over the workers, and each keeps its own record of the
media the fleet holds (journey/held.py). A turn landing on a worker that never saw its history
had those images encoded again: at `--workers 2`, 1.45x the images of one process on the agent
workload. The EC store holds an image for every consumer once any encoder answered for it, so a
name one worker saw encoded is as good for the others.

Each worker binds a Unix datagram socket, named by its pid, in a directory only the supervisor's
user can enter (`SIBLINGS_ENV` names it), and sends the names it saw encoded to every other socket
there. Nothing waits on a sibling to be told: a full or gone socket drops the datagram, which
costs at most an encode the record would otherwise have spared.

A worker that starts asks the others for their records (`ASK`), and each answers with its names
and their ages (`REPLAY`): a worker the supervisor put in place of a dead one, or one that bound
its socket after the others had begun telling (at start, the first worker serves before the
second listens), would otherwise start without what its siblings saw. The names keep their ages,
so a name lives no longer for having been replayed. Siblings tell each other every name, so
their records are alike: the starting worker waits (up to CATCH_UP_S) for the first whole answer
only. An answer goes from a socket of its own, so a slow reader's queue never holds up what the
answering worker tells the others.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import socket
from collections.abc import Iterable
from typing import Protocol

log = logging.getLogger("epd_proxy.siblings")

# The environment variable that names the directory of the workers' sockets (set by the supervisor).
SIBLINGS_ENV = "EPD_PROXY_SIBLINGS_DIR"
# Names per datagram: 33 bytes each (41 with an age), well under a Unix datagram's default limit.
NAMES_PER_DATAGRAM = 1024
# held.media_names: 16-byte blake2b digests in hex.
_NAME = re.compile(rb"[0-9a-f]{32}")
SUFFIX = ".sock"
# A starting worker's question, the first line of each datagram of an answer (then lines of
# "<name> <age in ms>"), and an answer's end.
ASK = b"epd-proxy siblings: what did you see encoded?"
REPLAY = b"epd-proxy siblings: seen encoded\n"
REPLAYED = b"epd-proxy siblings: that is all"
_AGED = re.compile(rb"^([0-9a-f]{32}) ([0-9]{1,12})$", re.MULTILINE)
# How long an answer may wait for room in the asking worker's socket before the rest is dropped.
REPLAY_DEADLINE_S = 5.0
REPLAY_RETRY_S = 0.01
# How long a starting worker waits for its siblings' answers before it serves without the rest.
CATCH_UP_S = 2.0


def names_in(data: bytes) -> list[str]:
    """The names of the proxy's own form in a message another process sent; nothing else."""
    return [match.decode() for match in _NAME.findall(data)]


def aged_names_in(data: bytes) -> list[tuple[str, float]]:
    """The names and ages (seconds) in a sibling's answer; lines of any other form are skipped."""
    return [(name.decode(), int(ms) / 1000) for name, ms in _AGED.findall(data)]


class Record(Protocol):
    """What a worker keeps of the media the fleet holds (journey/held.py's HeldMedia)."""

    def encoded_elsewhere(self, names: Iterable[str]) -> None: ...
    def encoded_earlier(self, aged: Iterable[tuple[str, float]]) -> None: ...
    def encoded_record(self) -> list[tuple[str, float]]: ...


class Siblings:
    """This worker's socket among its siblings'."""

    def __init__(self, directory: str, name: str = "") -> None:
        self.directory = directory
        self.path = os.path.join(directory, name or f"{os.getpid()}{SUFFIX}")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.bind(self.path)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._answers: set[asyncio.Task[None]] = set()
        # Set when the first whole answer to this worker's question has come.
        self._caught_up = asyncio.Event()
        self.told = self.heard = self.dropped = 0

    @classmethod
    def join(cls, directory: str | None) -> Siblings | None:
        """This worker's place among the siblings in `directory`; None when it serves alone."""
        if not directory:
            return None
        try:
            return cls(directory)
        except OSError as exc:
            log.warning("cannot share what this worker sees encoded with the others (%s): each keeps its own", exc)
            return None

    async def listen(self, record: Record, catch_up_s: float = CATCH_UP_S) -> None:
        """Keep in `record` what the siblings tell and answer their questions from it, from this
        event loop; ask each of them for theirs and wait, up to `catch_up_s`, for the first whole
        answer."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._read, record)
        asked = sum(self._send(ASK, path) for path in self._peers())
        if not asked:
            return
        try:
            await asyncio.wait_for(self._caught_up.wait(), catch_up_s)
        except TimeoutError:
            log.info("no sibling had told all it saw encoded after %.0f s; serving meanwhile", catch_up_s)

    def _read(self, record: Record) -> None:
        while True:
            try:
                datagram, sender = self._sock.recvfrom(1 << 16)
            except OSError:  # nothing more to read now (BlockingIOError), or the socket is gone
                return
            if datagram == ASK:
                if isinstance(sender, str) and sender.startswith(self.directory + os.sep):
                    self._answer(sender, record.encoded_record())
            elif datagram.startswith(REPLAY):
                aged = aged_names_in(datagram)
                self.heard += len(aged)
                record.encoded_earlier(aged)
            elif datagram == REPLAYED:
                self._caught_up.set()
            else:
                names = names_in(datagram)
                if names:
                    self.heard += len(names)
                    record.encoded_elsewhere(names)

    def _answer(self, path: str, aged: list[tuple[str, float]]) -> None:
        if self._loop is None:
            return
        task = self._loop.create_task(self._replay(path, aged))
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)

    async def _replay(self, path: str, aged: list[tuple[str, float]]) -> None:
        """Send the record in datagrams from a socket of its own, each made between turns of this
        worker's loop, then its end, up to REPLAY_DEADLINE_S in all; closing that socket then
        frees what the asking worker never read."""
        give_up = asyncio.get_running_loop().time() + REPLAY_DEADLINE_S
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as answering:
            answering.setblocking(False)
            for at in range(0, len(aged), NAMES_PER_DATAGRAM):
                chunk = aged[at : at + NAMES_PER_DATAGRAM]
                lines = "\n".join(f"{name} {int(age_s * 1000)}" for name, age_s in chunk)
                if not await self._deliver(answering, REPLAY + lines.encode(), path, give_up):
                    return
            await self._deliver(answering, REPLAYED, path, give_up)

    async def _deliver(self, sock: socket.socket, datagram: bytes, path: str, give_up: float) -> bool:
        """Send one datagram of an answer, waiting for room in the asking worker's socket (which
        reads as its event loop turns) until `give_up`; False when it was not sent."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock.sendto(datagram, path)
                self.told += 1
                await asyncio.sleep(0)
                return True
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    log.debug("answering a sibling: %s", exc)  # it went, most likely
                    return False
            if loop.time() > give_up:
                self.dropped += 1
                return False
            await asyncio.sleep(REPLAY_RETRY_S)

    def _peers(self) -> list[str]:
        """The other workers' sockets now bound in the directory."""
        try:
            entries = os.listdir(self.directory)
        except OSError:
            return []
        paths = (os.path.join(self.directory, entry) for entry in entries if entry.endswith(SUFFIX))
        return [path for path in paths if path != self.path]

    def _send(self, datagram: bytes, path: str) -> bool:
        try:
            self._sock.sendto(datagram, path)
            self.told += 1
            return True
        except (BlockingIOError, InterruptedError):
            self.dropped += 1  # that sibling is behind: it encodes again, nothing worse
        except (ConnectionRefusedError, FileNotFoundError):
            # A worker that died: nobody reads its socket any more.
            try:
                os.unlink(path)
            except OSError:
                pass
        except OSError:
            self.dropped += 1
        return False

    def tell(self, names: Iterable[str]) -> None:
        """Send `names` to every sibling now bound in the directory."""
        batch = list(names)
        if not batch:
            return
        peers = self._peers()
        for start in range(0, len(batch), NAMES_PER_DATAGRAM):
            datagram = "\n".join(batch[start : start + NAMES_PER_DATAGRAM]).encode()
            for path in peers:
                self._send(datagram, path)

    def close(self) -> None:
        for task in self._answers:
            task.cancel()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
