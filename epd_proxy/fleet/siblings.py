"""`serve --workers`: what one worker saw encoded, told to the others of the same port.

The kernel spreads a conversation's turns over the workers, and each keeps its own record of the
media the fleet holds (journey/held.py). A turn landing on a worker that never saw its history
had those images encoded again: at `--workers 2`, 1.45x the images of one process on the agent
workload. The EC store holds an image for every consumer once any encoder answered for it, so a
name one worker saw encoded is as good for the others.

Each worker binds a Unix datagram socket, named by its pid, in a directory only the supervisor's
user can enter (`SIBLINGS_ENV` names it), and sends the names it saw encoded to every other socket
there. Nothing waits on a sibling: a full or gone socket drops the datagram, which costs at most
an encode the record would otherwise have spared.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from collections.abc import Callable, Iterable

log = logging.getLogger("epd_proxy.siblings")

# The environment variable that names the directory of the workers' sockets (set by the supervisor).
SIBLINGS_ENV = "EPD_PROXY_SIBLINGS_DIR"
# Names per datagram: 33 bytes each, well under a Unix datagram's default limit.
NAMES_PER_DATAGRAM = 1024
# held.media_names: 16-byte blake2b digests in hex.
_NAME = re.compile(rb"[0-9a-f]{32}")
SUFFIX = ".sock"


def names_in(data: bytes) -> list[str]:
    """The names of the proxy's own form in a message another process sent; nothing else."""
    return [match.decode() for match in _NAME.findall(data)]


class Siblings:
    """This worker's socket among its siblings'."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, f"{os.getpid()}{SUFFIX}")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.bind(self.path)
        self._loop: asyncio.AbstractEventLoop | None = None
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

    def listen(self, heard: Callable[[list[str]], None]) -> None:
        """Hand each name a sibling tells to `heard`, from this event loop."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._read, heard)

    def _read(self, heard: Callable[[list[str]], None]) -> None:
        while True:
            try:
                datagram = self._sock.recv(1 << 16)
            except OSError:  # nothing more to read now (BlockingIOError), or the socket is gone
                return
            names = names_in(datagram)
            if names:
                self.heard += len(names)
                heard(names)

    def tell(self, names: Iterable[str]) -> None:
        """Send `names` to every sibling now bound in the directory."""
        batch = list(names)
        if not batch:
            return
        try:
            peers = [entry for entry in os.listdir(self.directory) if entry.endswith(SUFFIX)]
        except OSError:
            return
        for start in range(0, len(batch), NAMES_PER_DATAGRAM):
            datagram = "\n".join(batch[start : start + NAMES_PER_DATAGRAM]).encode()
            for entry in peers:
                path = os.path.join(self.directory, entry)
                if path == self.path:
                    continue
                try:
                    self._sock.sendto(datagram, path)
                    self.told += 1
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

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
