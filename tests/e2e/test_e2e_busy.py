"""A real PD at its queue limit (`--max-num-queued-reqs`): vLLM refuses the next request with a 503
before its engine sees it, in the shape the fake vLLM answers, and the proxy hands the request to
the other PD, whose answer equals the single instance's.

The PD is held at its limit without timing: its scheduler is paused with `POST /pause?mode=keep`
(vLLM's dev endpoints, on in the e2e stacks), and `BUSY_AT` streams are opened on it. A stream's
200 arrives once admission let it in, and it stays unfinished until `/resume`."""

from __future__ import annotations

import http.client
import json
import urllib.parse
import urllib.request
from contextlib import ExitStack

from prometheus_client.parser import text_string_to_metric_families

from epd_proxy_tools.testing.fake_vllm import QUEUE_OVERFLOW
from epd_proxy_tools.testing.polling import eventually_sync

from .e2e_helpers import (
    BUSY_AT,
    LOWERCASE_IDS,
    MODEL,
    TWO_PDS,
    chat_body,
    chat_ok,
    extra_proxy,
    finished_requests,
    image_source,
    post_json,
)

fresh = image_source(range(7400, 7420))


def control(url: str, path: str) -> None:
    request = urllib.request.Request(url + path, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert resp.status == 200


def open_stream(url: str) -> http.client.HTTPConnection:
    """A streaming chat request to `url` whose 200 has arrived: admitted, and unfinished while paused."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Wait."}], "max_tokens": 4, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return conn


def refusals(url: str) -> float:
    """vLLM's own count of the requests its admission control refused for the queue limit."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        families = text_string_to_metric_families(resp.read().decode())
        return sum(
            sample.value
            for family in families
            if family.name == "vllm:admission_rejections"
            for sample in family.samples
            if sample.name.endswith("_total") and sample.labels.get("reason") == "max_num_queued_reqs"
        )


def test_a_pd_at_its_queue_limit_hands_the_request_to_the_other_pd_and_the_answer_is_exact(two_pd_stack, fidelity):
    st = two_pd_stack
    busy, free = st.consumer_urls
    pds = ",".join(st.consumer_urls)
    with (
        extra_proxy(st, "busy-pd-proxy", "--decode-policy", "round_robin", decode_url=pds) as proxy,
        ExitStack() as held,
    ):
        control(busy, "/pause?mode=keep&clear_cache=false")
        held.callback(control, busy, "/resume")
        streams = [open_stream(busy) for _ in range(BUSY_AT)]
        for conn in streams:
            held.callback(conn.close)
        # Straight to the PD: vLLM's refusal, word for word what the fake answers.
        status, refusal = post_json(busy, chat_body([]))
        assert status == 503
        assert refusal == {
            "error": {"message": QUEUE_OVERFLOW, "type": "Service Unavailable", "param": None, "code": 503}
        }
        before = {url: finished_requests(url) for url in st.consumer_urls}
        refused = refusals(busy)
        # Round robin: one of two requests is placed on the busy PD first.
        for n, image in enumerate(fresh(2)):
            body = chat_body([image], temperature=0, seed=1234, max_tokens=8, allowed_token_ids=LOWERCASE_IDS)
            answer = chat_ok(proxy, body)
            fidelity.check(f"a PD at its queue limit, request {n + 1}", answer, chat_ok(st.baseline_url, body), TWO_PDS)
        assert refusals(busy) >= refused + 1
        # vLLM counts a request finished after its answer went out: wait for the count to settle.
        eventually_sync(
            lambda: finished_requests(free) - before[free] == 2, timeout=15, what="the other PD answered both"
        )
        assert finished_requests(busy) == before[busy]
