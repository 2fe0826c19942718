"""The status page's sliding window, on a driven clock."""

from __future__ import annotations

from epd_proxy.journey.trace import Trace
from epd_proxy.ops.recent import RecentRequests, percentile


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def trace(items=0, subrequests=0, attempts=1, failovers=0, encode=0.0, prefill=0.0, ttfb=0.0) -> Trace:
    t = Trace("r", started=0.0)
    t.items, t.encoder_requests, t.attempts, t.encoder_failovers = items, subrequests, attempts, failovers
    t.subrequest_share = float(subrequests)
    t.encode_s, t.prefill_s, t.decode_ttfb_s = encode, prefill, ttfb
    return t


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 0.5) == 50
    assert percentile(values, 0.99) == 99
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) is None


def test_rate_status_mix_and_latency_over_the_window():
    clock = Clock()
    recent = RecentRequests(window_s=60, clock=clock)
    clock.now += 100  # up long enough that the whole window counts
    for i in range(100):
        status = 200 if i < 90 else 502
        recent.record(clock.now, status, total_s=(i + 1) / 1000, trace=trace(ttfb=(i + 1) / 2000))
    summary = recent.summary()
    assert summary["requests"] == 100
    assert summary["rate_per_s"] == round(100 / 60, 2)
    assert summary["status"] == {"200": 90, "502": 10}
    assert summary["latency"]["total"] == {"count": 100, "p50_ms": 50.0, "p99_ms": 99.0}
    assert summary["latency"]["decode_ttfb"]["p50_ms"] == 25.0
    # Stages a request never reached are not zeros in the percentiles.
    assert summary["latency"]["encode"] == {"count": 0, "p50_ms": None, "p99_ms": None}
    assert summary["latency"]["prefill"]["count"] == 0


def test_requests_older_than_the_window_drop_out():
    clock = Clock()
    recent = RecentRequests(window_s=60, clock=clock)
    recent.record(clock.now, 200, 0.01, trace())
    clock.now += 30
    recent.record(clock.now, 200, 0.01, trace())
    assert recent.summary()["requests"] == 2
    clock.now += 45
    summary = recent.summary()
    assert summary["requests"] == 1
    assert summary["window_s"] == 60


def test_a_young_proxy_divides_by_its_age_not_the_window():
    clock = Clock()
    recent = RecentRequests(window_s=60, clock=clock)
    clock.now += 5
    for _ in range(10):
        recent.record(clock.now, 200, 0.01, trace())
    summary = recent.summary()
    assert summary["window_s"] == 5
    assert summary["rate_per_s"] == 2.0


def test_an_overflowing_ring_reports_the_span_it_still_holds():
    clock = Clock()
    recent = RecentRequests(window_s=60, capacity=10, clock=clock)
    clock.now += 100
    for _ in range(40):
        clock.now += 0.5
        recent.record(clock.now, 200, 0.01, trace())
    summary = recent.summary()
    assert summary["requests"] == 10
    # The ten kept requests span 4.5 s: 10 / 4.5, not 10 / 60.
    assert summary["rate_per_s"] == round(10 / 4.5, 2)


def test_batching_retries_and_failovers():
    clock = Clock()
    recent = RecentRequests(window_s=60, clock=clock)
    clock.now += 60
    # 4 images in 2 sub-requests; 6 images in 2 sub-requests; a text-only request.
    recent.record(clock.now, 200, 0.1, trace(items=4, subrequests=2, encode=0.02))
    recent.record(clock.now, 200, 0.1, trace(items=6, subrequests=2, encode=0.04, failovers=1))
    recent.record(clock.now, 200, 0.1, trace())
    # A retried request re-encodes: 2 images twice, in 2 sub-requests over both attempts.
    recent.record(clock.now, 200, 0.1, trace(items=2, subrequests=2, attempts=2, encode=0.03))
    recent.record(clock.now, 503, 0.001, trace())
    summary = recent.summary()
    assert summary["requests_with_media"] == 3
    assert summary["subrequests_per_request"] == 2.0
    assert summary["images_per_subrequest"] == round((4 + 6 + 4) / 6, 2)
    assert summary["retries"] == 1
    assert summary["failovers"] == 1
    assert summary["status"] == {"200": 4, "503": 1}
    assert summary["latency"]["total"]["count"] == 5
    assert summary["latency"]["encode"] == {"count": 3, "p50_ms": 30.0, "p99_ms": 40.0}


def test_the_timeline_buckets_rate_and_latency_and_starts_with_the_process():
    clock = Clock()
    recent = RecentRequests(clock=clock)
    clock.now += 25.0
    for n in range(20):  # 20 requests in the last 10 s, 100 ms .. 2 s each
        recent.record(clock.now - 5.0, 200, 0.1 * (n + 1), trace())
    line = recent.timeline(bucket_s=10.0, buckets=30)
    assert [b["ago_s"] for b in line] == [20.0, 10.0, 0.0], "nothing from before the process started"
    assert [b["rate_per_s"] for b in line] == [0.0, 0.0, 2.0]
    assert line[-1]["p50_ms"] == 1000.0 and line[-1]["p99_ms"] == 2000.0


def test_the_slowest_requests_name_the_stage_they_waited_in():
    clock = Clock()
    recent = RecentRequests(window_s=60, clock=clock)
    for n in range(8):
        t = trace(items=1, subrequests=1, encode=0.02, ttfb=0.01)
        t.request_id = f"r{n}"
        recent.record(clock.now, 200, 0.05, t)
    queued = trace(items=1, subrequests=1, encode=2.5, ttfb=0.01)
    queued.request_id, queued.share_wait_s = "queued", 2.4
    recent.record(clock.now, 200, 2.6, queued)
    slow_pd = trace(items=1, subrequests=1, encode=0.02, ttfb=1.5)
    slow_pd.request_id, slow_pd.endpoint = "slow-pd", "responses"
    recent.record(clock.now, 200, 1.6, slow_pd)
    slowest = recent.summary()["slowest"]
    assert [s["request_id"] for s in slowest][:2] == ["queued", "slow-pd"] and len(slowest) == 5
    assert slowest[0]["waited_in"] == "encode_queue"
    assert slowest[0]["stages_ms"]["encode_queue"] == 2400.0 and slowest[0]["stages_ms"]["encoders"] == 100.0
    assert (slowest[1]["waited_in"], slowest[1]["endpoint"]) == ("decode", "responses")


def test_a_request_that_reached_no_stage_waited_nowhere():
    assert Trace("r").waited_in() is None
    t = Trace("r")
    t.read_s = 3.0  # a slow upload
    assert t.waited_in() == "read"
