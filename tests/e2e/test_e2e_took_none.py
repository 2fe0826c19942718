"""Real PDs that take none of a request, and the proxy handing it to the other PD, whose answer
equals the single instance's:

- a PD at its queue limit (`--max-num-queued-reqs`): vLLM refuses the next request with a 503
  before its engine sees it, in the shape the fake vLLM answers;
- a PD that aborts the request before its engine ran it (`POST /pause?mode=abort`, what a
  shutdown does too): vLLM answers 200 with no token generated;
- a PD that aborts a non-streamed request partway: vLLM answers 200 with the text so far, which
  chat and Messages tell (the doors' judges are held to the real bytes here).

Without timing: the PD's scheduler is paused with `POST /pause?mode=keep` (vLLM's dev endpoints,
on in the e2e stacks), so what it admitted stays unfinished until `/resume`; a stream's 200 says it
was admitted, and a request vLLM cannot load says whether the PD is at its limit (400 after
admission, 503 at the limit) without becoming a request itself."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from typing import Any

from epd_proxy.calls.sse import Verdict, output_tokens
from epd_proxy.journey.doors import CHAT
from epd_proxy.journey.messages_api import MESSAGES
from epd_proxy.journey.responses_api import RESPONSES
from epd_proxy_tools.local.tiny_model import SPECIAL_IDS
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
    metric_total,
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


def at_limit(url: str) -> bool:
    """Whether admission refuses the next request: a probe past admission fails to load its image."""
    probe = {"type": "image_url", "image_url": {"url": "data:epd-test-probe"}}
    status, _ = post_json(url, {"model": MODEL, "messages": [{"role": "user", "content": [probe]}], "max_tokens": 1})
    assert status in (400, 503), status
    return status == 503


def refusals(url: str) -> float:
    """vLLM's own count of the requests its admission control refused for the queue limit."""
    return metric_total(url, "vllm:admission_rejections_total", reason="max_num_queued_reqs")


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


def test_a_pd_that_aborts_a_request_before_running_it_hands_it_to_the_other_pd_exactly(two_pd_stack, fidelity):
    st = two_pd_stack
    aborting, free = st.consumer_urls
    pds = ",".join(st.consumer_urls)
    body = chat_body(fresh(1), temperature=0, seed=1234, max_tokens=8, allowed_token_ids=LOWERCASE_IDS)
    answers: list[dict] = []
    with (
        extra_proxy(st, "aborting-pd-proxy", "--decode-policy", "round_robin", decode_url=pds) as proxy,
        ExitStack() as held,
    ):
        client = threading.Thread(target=lambda: answers.append(chat_ok(proxy, body)))
        # Let go in the reverse order: the PD resumes before the client is waited for.
        held.callback(lambda: client.is_alive() and client.join(120))
        control(aborting, "/pause?mode=keep&clear_cache=false")
        held.callback(control, aborting, "/resume")
        # One request of the test's own, then the proxy's (round robin places its first on the
        # first PD): both unfinished, the PD is at its limit of 2.
        held.callback(open_stream(aborting).close)
        before = finished_requests(free)
        client.start()
        eventually_sync(lambda: at_limit(aborting), timeout=60, what="the proxy's request reached the paused PD")
        assert not answers
        control(aborting, "/pause?mode=abort&clear_cache=false")
        client.join(120)
        assert len(answers) == 1, "the proxy answered"
        eventually_sync(lambda: finished_requests(free) - before == 1, timeout=15, what="the other PD answered it")
    fidelity.check("a PD aborted the request before running it", answers[0], chat_ok(st.baseline_url, body), TWO_PDS)


# Long enough that the engine is still generating when the test freezes it (the tiny model writes
# about 330 tokens a second on an idle machine), within the stack's --max-model-len.
LONG = 1800
TRIES = 3


def abort_partway(url: str, send: Callable[[], Any], landed: Callable[[Any], bool]) -> Any:
    """What `send` (a request whose generation lands on the PD at `url`) returns, run in a thread
    while the test freezes the PD once it has generated a few tokens, and aborts what it runs. A
    request the PD finished before it froze (`landed` says no) is sent again, up to TRIES times."""
    for _ in range(TRIES):
        got = _abort_once(url, send)
        if landed(got):
            return got
    raise AssertionError(f"the PD finished the request before it was frozen, {TRIES} times")


def _abort_once(url: str, send: Callable[[], Any]) -> Any:
    before = metric_total(url, "vllm:generation_tokens_total")
    got: list[Any] = []
    client = threading.Thread(target=lambda: got.append(send()))
    with ExitStack() as held:
        held.callback(lambda: client.is_alive() and client.join(180))
        client.start()
        eventually_sync(
            lambda: metric_total(url, "vllm:generation_tokens_total") >= before + 5,
            timeout=60,
            interval=0.01,
            what="the PD generating",
        )
        control(url, "/pause?mode=keep&clear_cache=false")
        held.callback(control, url, "/resume")
        control(url, "/pause?mode=abort&clear_cache=false")
        client.join(180)
    assert len(got) == 1, "the request was answered"
    return got[0]


def aborts(url: str) -> float:
    return metric_total(url, "vllm:request_success_total", finished_reason="abort")


def cut_short(raw: bytes) -> bool:
    return output_tokens(json.loads(raw)["usage"]) < LONG


def post_raw(url: str, path: str, body: dict) -> bytes:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=180) as resp:
        assert resp.status == 200
        return resp.read()


def test_vllm_answers_a_request_aborted_partway_as_the_doors_judge_it(two_pd_stack):
    """Straight to a PD: chat says `abort`, Messages leaves its stop reason out, Responses says
    `completed` (so the proxy cannot tell, and relays it)."""
    pd = two_pd_stack.consumer_urls[0]
    # The tiny model's greedy answer to this prompt runs to the budget (some prompts end in a few
    # hundred tokens); chat's allowed ids leave the end-of-sequence token out as well.
    prompt = "Keep writing."
    ask = [{"role": "user", "content": prompt}]
    cases = [
        (CHAT, {"messages": ask, "max_tokens": LONG, "allowed_token_ids": LOWERCASE_IDS}, Verdict.CUT),
        (MESSAGES, {"messages": ask, "max_tokens": LONG}, Verdict.CUT),
        (RESPONSES, {"input": prompt, "max_output_tokens": LONG}, Verdict.COMMIT),
    ]
    for door, body, verdict in cases:
        send = partial(post_raw, pd, door.path, {"model": MODEL, "temperature": 0, **body})
        raw = abort_partway(pd, send, landed=cut_short)
        assert output_tokens(json.loads(raw)["usage"]) > 0, raw
        assert door.judge(raw) is verdict, raw


# The tiny vision model's end-of-sequence token (its config's eos_token_id).
END_OF_SEQUENCE = SPECIAL_IDS["<|im_end|>"]


def test_vllm_answers_it_finished_are_judged_finished(two_pd_stack):
    """The judges' other side on real answers, each way vLLM ends a request here: at the
    end-of-sequence token, at a stop token or string, and at the budget. A false "aborted" would
    send a finished request again. The seeded tiny model's greedy answer reaches its end-of-sequence
    token on some CPUs and not on others (their kernels round differently; on one it ran past 1,900
    tokens), so each ending is made certain: the end-of-sequence token as the only one allowed, and
    a stop token and string taken from the answer's own start."""
    pd = two_pd_stack.consumer_urls[0]
    prompt = "Count to one thousand."
    ask = [{"role": "user", "content": prompt}]
    start = json.loads(
        post_raw(
            pd,
            CHAT.path,
            {"model": MODEL, "temperature": 0, "messages": ask, "max_tokens": 32, "return_token_ids": True},
        )
    )["choices"][0]
    # The answer's fourth token, and its first printable ASCII character (a byte of a character
    # split over tokens could read differently once the rest follows): the answer stops there.
    stop_token = start["token_ids"][3]
    stop_text = next(c for c in start["message"]["content"] if c.isascii() and c.isprintable())
    cases = [
        (CHAT, {"messages": ask, "max_tokens": 400, "allowed_token_ids": [END_OF_SEQUENCE]}, ("finish_reason", "stop")),
        (CHAT, {"messages": ask, "max_tokens": 400, "stop_token_ids": [stop_token]}, ("finish_reason", "stop")),
        (CHAT, {"messages": ask, "max_tokens": 8}, ("finish_reason", "length")),
        (
            MESSAGES,
            {"messages": ask, "max_tokens": 400, "stop_sequences": [stop_text]},
            ("stop_reason", "stop_sequence"),
        ),
        (MESSAGES, {"messages": ask, "max_tokens": 8}, ("stop_reason", "max_tokens")),
        (
            RESPONSES,
            {"input": prompt, "max_output_tokens": 400, "stop_token_ids": [stop_token]},
            ("status", "completed"),
        ),
        (RESPONSES, {"input": prompt, "max_output_tokens": 8}, ("status", "incomplete")),
    ]
    for door, body, (field, ending) in cases:
        raw = post_raw(pd, door.path, {"model": MODEL, "temperature": 0, **body})
        answer = json.loads(raw)
        said = answer["choices"][0][field] if door is CHAT else answer[field]
        assert said == ending, raw
        assert door.judge(raw) is Verdict.COMMIT, raw


def test_a_pd_that_aborts_a_request_partway_hands_it_to_the_other_pd_exactly(two_pd_stack, fidelity):
    st = two_pd_stack
    aborting, free = st.consumer_urls
    pds = ",".join(st.consumer_urls)
    body = chat_body(fresh(1), temperature=0, seed=1234, max_tokens=LONG, allowed_token_ids=LOWERCASE_IDS)

    def through_a_fresh_proxy() -> dict:
        # Round robin places a fresh proxy's first request on the first PD.
        with extra_proxy(st, "partway-pd-proxy", "--decode-policy", "round_robin", decode_url=pds) as proxy:
            return chat_ok(proxy, body)

    before, aborted = finished_requests(free), aborts(aborting)
    answer = abort_partway(aborting, through_a_fresh_proxy, landed=lambda _: aborts(aborting) > aborted)
    eventually_sync(lambda: finished_requests(free) - before == 1, timeout=15, what="the other PD answered it")
    assert answer["choices"][0]["finish_reason"] == "length"
    fidelity.check("a PD aborted the request partway", answer, chat_ok(st.baseline_url, body), TWO_PDS)
