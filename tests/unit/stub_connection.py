"""A connection fed bytes by hand: a stub transport instead of a socket, and a stub pool that
records what the connection and its answer report."""

from __future__ import annotations

from epd_proxy.calls.connection import Connection, Limits


class Transport:
    def __init__(self) -> None:
        self.aborted = False
        self.paused = 0
        self.resumed = 0

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        self.paused += 1

    def resume_reading(self) -> None:
        self.resumed += 1

    def is_closing(self) -> bool:
        return self.aborted

    def get_extra_info(self, name: str):
        return None


class Pool:
    """What a connection and an answer ask of their pool."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        self.refused: list[tuple[str, str]] = []
        self.given_back: list[bool] = []

    def _refused(self, stage: str, reason: str) -> None:
        self.refused.append((stage, reason))

    def give_back(self, url: str, conn: Connection, reuse: bool) -> None:
        self.given_back.append(reuse)


def connection(limits: Limits = Limits(), *, stage: str | None = "decode", max_body: int | None = None):
    pool = Pool(limits)
    # No loop: everything here is fed before it is read, so nothing waits.
    conn = Connection(None, pool.limits, pool._refused)
    conn.connection_made(Transport())
    if stage is not None:
        conn.begin(stage, max_body)
    return conn, pool


def body_of(conn: Connection) -> bytes:
    return b"".join(conn.take() for _ in range(len(conn.chunks)))
