"""SSE framing by the spec (WHATWG HTML, server-sent events): a line ends with CRLF, LF or CR, an
empty line ends an event. Whatever the line ends and however the stream is cut into chunks, the
framer passes on the same whole events, bytes unchanged, as soon as each one has ended."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_proxy.calls.sse import EventTooLarge, Framer, Head, Verdict, events

LINE_ENDS = (b"\n", b"\r\n", b"\r")
line_texts = st.text(alphabet='data: {}"éx,\\', min_size=1, max_size=12).map(str.encode)
lines = st.tuples(line_texts, st.sampled_from(LINE_ENDS))
# An event is its lines and their line ends, then the line end of the empty line that ends it.
event_shapes = st.lists(st.tuples(st.lists(lines, max_size=3), st.sampled_from(LINE_ENDS)), max_size=6)
partials = st.lists(lines, max_size=3)  # an event that never ends
splits = st.lists(st.integers(0, 400), max_size=12)


def build(shapes: list, partial: list) -> tuple[list[bytes], list[int], bytes]:
    """The events as bytes, the length of each one's body (all but the line end of its empty line),
    and a last event that never ends. A CR followed by LF is one line end (CRLF), so an empty
    line's bare LF right after a CR is written as CRLF instead: that is the stream the shapes mean."""
    out: list[bytes] = []
    bodies: list[int] = []
    previous = b""
    for event_lines, blank in shapes:
        body = b"".join(text + end for text, end in event_lines)
        if blank == b"\n" and (body or previous).endswith(b"\r"):
            blank = b"\r\n"
        out.append(body + blank)
        bodies.append(len(body))
        previous = out[-1]
    return out, bodies, b"".join(text + end for text, end in partial)


def cuts_of(length: int, points: list[int]) -> list[int]:
    return sorted(min(p, length) for p in points)


def known_after(evs: list[bytes], position: int) -> int:
    """How many bytes of whole events are known after `position` bytes: an event whose empty line
    ends in CRLF has ended at its CR already (the LF is passed on when it comes)."""
    known = end = 0
    for event in evs:
        end += len(event)
        if end <= position:
            known = end
        elif end - 1 == position and event.endswith(b"\r\n"):
            known = position
    return known


def feed_all(framer: Framer, stream: bytes, cuts: list[int]) -> Iterator[tuple[int, bytes]]:
    """Each chunk's end position and what the framer passed on for it."""
    start = 0
    for cut in [*cuts, len(stream)]:
        yield cut, framer.feed(stream[start:cut])
        start = cut


@settings(max_examples=400, deadline=None)
@given(event_shapes, partials, splits)
def test_any_split_under_any_line_ends_gives_the_same_events_as_soon_as_they_end(shapes, partial, points):
    evs, _, rest = build(shapes, partial)
    stream = b"".join(evs) + rest
    framer = Framer()
    passed = b""
    for position, ready in feed_all(framer, stream, cuts_of(len(stream), points)):
        passed += ready
        assert len(passed) == known_after(evs, position)
    assert passed + framer.pending == stream
    assert passed == b"".join(evs) and events(passed) == evs


@settings(max_examples=400, deadline=None)
@given(event_shapes, partials, splits, st.integers(4, 30))
def test_an_event_over_the_cap_stops_the_stream_after_the_events_before_it(shapes, partial, points, cap):
    evs, bodies, rest = build(shapes, partial)
    stream = b"".join(evs) + rest
    over = next((n for n, body in enumerate(bodies) if body > cap), None)
    if over is None and len(rest) > cap:
        over = len(evs)
    framer = Framer(max_event_bytes=cap)
    passed = b""
    try:
        for _, ready in feed_all(framer, stream, cuts_of(len(stream), points)):
            passed += ready
    except EventTooLarge as exc:
        assert over is not None and exc.limit == cap
        assert passed + exc.ready == b"".join(evs[:over])
    else:
        assert over is None and passed == b"".join(evs)
        assert len(framer.pending) <= cap


@pytest.mark.parametrize("end", LINE_ENDS)
def test_each_event_goes_out_when_it_ends(end):
    first = b"data: one" + end + end
    second = b": note" + end + b"data: two" + end + end
    framer = Framer()
    assert framer.feed(first[:-1]) == (first if end == b"\r\n" else b"")[:-1]
    assert framer.feed(first[-1:] + second[:4]) == (b"\n" if end == b"\r\n" else first)
    assert framer.feed(second[4:]) == second
    assert framer.pending == b""


def test_a_cr_that_ends_an_event_is_passed_on_at_once_and_its_lf_follows_it():
    framer = Framer()
    assert framer.feed(b"data: a\r\n\r") == b"data: a\r\n\r"
    assert framer.feed(b"\n") == b"\n"
    assert framer.feed(b"data: b\r") == b""
    assert framer.feed(b"\r") == b"data: b\r\r"
    assert framer.feed(b"data: c\r\r") == b"data: c\r\r"  # no LF came: the CR alone ended it


def test_a_crlf_split_between_its_bytes_is_one_line_end():
    framer = Framer()
    assert framer.feed(b"data: a\r") == b""
    assert framer.feed(b"\n") == b""  # the end of the line, not an empty line
    assert framer.feed(b"data: b\n") == b""
    assert framer.feed(b"\n") == b"data: a\r\ndata: b\n\n"


def test_the_buffer_holds_only_the_unfinished_event_and_never_more_than_the_cap():
    framer = Framer(max_event_bytes=1000)
    for _ in range(100):
        assert framer.feed(b"data: 0123456789\n") == b""
        assert framer.feed(b"\n") == b"data: 0123456789\n\n"
        assert framer.pending == b""
    framer.feed(b"data: " + b"y" * 990)
    assert len(framer.pending) == 996
    with pytest.raises(EventTooLarge) as raised:
        framer.feed(b"y" * 5)
    assert raised.value.ready == b""


VLLM_EVENTS = {
    "role": b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"finish_reason":null}]}\n\n',
    "error": b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, '
    b'"code": 500}}\n\n',
    "content": b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n',
    "done": b"data: [DONE]\n\n",
}


def framed(names: list[str], end: bytes) -> bytes:
    return b"".join(VLLM_EVENTS[name].replace(b"\n", end) for name in names)


def judged(stream: bytes, cuts: list[int]) -> tuple[Verdict, dict | None]:
    head, start = Head(), 0
    for cut in [*cuts, len(stream)]:
        verdict, error = head.judge(stream[start:cut])
        if verdict is not Verdict.HOLD:
            return verdict, error
        start = cut
    return Verdict.HOLD, None


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(LINE_ENDS), splits)
def test_vllms_in_band_error_is_found_under_any_line_ends_and_split(end, points):
    stream = framed(["role", "error", "done"], end)
    verdict, error = judged(stream, cuts_of(len(stream), points))
    assert verdict is Verdict.ERROR and error["message"] == "Internal server error"
    stream = framed(["role", "content", "error"], end)
    assert judged(stream, cuts_of(len(stream), points))[0] is Verdict.COMMIT
    stream = framed(["role"], end)
    assert judged(stream, cuts_of(len(stream), points))[0] is Verdict.HOLD


def test_data_lines_are_read_by_the_spec_whatever_the_line_ends():
    # Two data lines are joined by LF; one space after the colon is dropped.
    assert judged(b'data:{"error":\r\ndata: {"message": "x"}}\r\n\r\n', [])[0] is Verdict.ERROR
    assert judged(b"data: [DONE]\r\r", [])[0] is Verdict.NOTHING
    assert judged(b": ping\r\n\r\nevent: x\r\r", []) == (Verdict.HOLD, None)
