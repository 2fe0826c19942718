"""A feed's reading of the subscription, batch by batch, without sockets (kv_events.py): what it
applies, what it leaves to a replay, and what it does without a replay socket. The feeds against
real sockets are tests/http/test_kv_events.py."""

from __future__ import annotations

from typing import Any

import msgspec

from epd_proxy.fleet.kv_events import GAP_LOST, RESTART, STALE_TURNS, UNDECODABLE, Feed, FeedCounts, Source
from epd_proxy.fleet.kv_index import FRESH, STALE, KvIndex
from epd_proxy.fleet.kv_names import chain
from epd_proxy.fleet.kv_wire import Batch, BlockStored, seq_bytes

ENGINE = ("http://pd:8000", 0)
BS = 4


class Counted(FeedCounts):
    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        super().__init__(stream=lambda url, what: self.seen.__setitem__(what, self.seen.get(what, 0) + 1))


def blocks(start: int, n: int = 1) -> list[tuple[list[int], None]]:
    return [(list(range(start + i * BS, start + (i + 1) * BS)), None) for i in range(n)]


def frames(seq: int, start: int, ts: float | None = None, block_hash: int | None = None) -> list[bytes]:
    tokens = [t for tokens, _ in blocks(start) for t in tokens]
    event = BlockStored(block_hashes=[block_hash or start + 1], token_ids=tokens, block_size=BS, medium="GPU")
    return [b"", seq_bytes(seq), msgspec.msgpack.encode(Batch(ts if ts is not None else float(seq), [event]))]


def feed(replay: str | None = "tcp://pd:5558") -> tuple[Feed, KvIndex, Counted]:
    index, counts = KvIndex(), Counted()
    made = Feed(ENGINE, Source("tcp://pd:5557", replay), index, context=Any, counts=counts)  # type: ignore[arg-type]
    index.watch(ENGINE)
    return made, index, counts


def test_batches_in_order_apply_and_keep_the_engine_fresh():
    made, index, _ = feed()
    assert made.receive(frames(0, 0)) is None and made.receive(frames(1, 100)) is None
    assert made.last == (1, 1.0) and index.state(ENGINE) == FRESH and index.complete(ENGINE)
    assert index.prefix_blocks(ENGINE, chain(blocks(100))) == 1


def test_the_first_batch_seen_after_numbers_began_makes_an_incomplete_view():
    made, index, _ = feed()
    made.receive(frames(40, 0))
    assert index.state(ENGINE) == FRESH and not index.complete(ENGINE)


def test_a_gap_or_an_older_number_is_left_to_a_replay_and_a_replayed_one_is_skipped():
    made, index, _ = feed()
    made.receive(frames(0, 0))
    assert made.receive(frames(2, 200)) is True  # a gap: nothing applied before the replay settles it
    assert index.prefix_blocks(ENGINE, chain(blocks(200))) == 0 and made.last == (0, 0.0)
    assert made.receive(frames(0, 999, ts=77.0)) is False  # an older number, another batch: restarted?
    made.last, made._replayed = (5, 5.0), {4: 4.0}
    assert made.receive(frames(4, 400)) is None  # brought by the last replay already
    assert made.last == (5, 5.0)


def test_without_a_replay_socket_a_gap_rebuilds_and_an_older_number_is_a_restart():
    made, index, counts = feed(replay=None)
    made.receive(frames(0, 0))
    made.receive(frames(3, 300))
    assert counts.seen == {GAP_LOST: 1, STALE_TURNS: 1}
    assert index.prefix_blocks(ENGINE, chain(blocks(0))) == 0 and index.prefix_blocks(ENGINE, chain(blocks(300))) == 1
    assert not index.complete(ENGINE)
    made.receive(frames(0, 500, ts=99.0))
    assert counts.seen[RESTART] == 1 and index.complete(ENGINE)
    assert index.prefix_blocks(ENGINE, chain(blocks(300))) == 0 and index.prefix_blocks(ENGINE, chain(blocks(500))) == 1


def test_a_batch_that_cannot_be_read_drops_the_view_and_the_next_rebuilds_it():
    made, index, counts = feed()
    made.receive(frames(0, 0))
    made.receive([b"", seq_bytes(1), b"\xc1"])
    assert counts.seen[UNDECODABLE] == 1 and index.state(ENGINE) == STALE and index.size(ENGINE) == 0
    made.receive([b"only two", b"frames"])
    assert counts.seen[UNDECODABLE] == 2
    made.receive(frames(2, 200))
    assert index.state(ENGINE) == FRESH and index.prefix_blocks(ENGINE, chain(blocks(200))) == 1


def test_extra_keys_vllm_never_sends_are_no_media_and_the_feed_goes_on():
    made, index, counts = feed()
    made.receive(frames(0, 0))
    # Extra keys that are a number, or an identifier no uuid is as long as: the wire format is not
    # that strict, and the feed used to end on the first.
    odd = BlockStored(
        block_hashes=[9], token_ids=[1, 2, 3, 4], block_size=BS, medium="GPU", extra_keys=[[7, ["x" * 300, 0]]]
    )
    assert made.receive([b"", seq_bytes(1), msgspec.msgpack.encode(Batch(1.0, [odd]))]) is None
    assert index.state(ENGINE) == FRESH and UNDECODABLE not in counts.seen
    assert index.media_holders("x" * 300) == []
    made.receive(frames(2, 200))
    assert index.prefix_blocks(ENGINE, chain(blocks(200))) == 1


def test_a_batch_the_index_cannot_apply_drops_the_view_and_the_feed_goes_on(monkeypatch):
    made, index, counts = feed()
    made.receive(frames(0, 0))
    apply = index.apply
    monkeypatch.setattr(index, "apply", lambda engine, events: (_ for _ in ()).throw(TypeError("odd")))
    assert made.receive(frames(1, 100)) is None
    assert counts.seen[UNDECODABLE] == 1 and index.state(ENGINE) == STALE and made.last is None
    monkeypatch.setattr(index, "apply", apply)
    made.receive(frames(2, 200))
    assert index.state(ENGINE) == FRESH and index.prefix_blocks(ENGINE, chain(blocks(200))) == 1
