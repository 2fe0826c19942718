"""E+PD over Mooncake on real vLLM: 2 encoders push their output to PD (`ECMooncakeConnector`,
TCP on loopback), the proxy naming PD's control address in every encoder request; the answers
are held against a plain vLLM instance.

A Mooncake consumer never encodes media itself (`ECMooncakeScheduler.ensure_cache_available`
holds a request until a push for each item arrives), so an exact answer here is one the pushes
made. The control at the end shows it: a proxy that does not name the consumer leaves PD waiting
out its push, and the counter of such waits, asserted 0 in every other case, sees it.

Tests run in file order; the encoder stopped mid-run and the control come last.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from epd_proxy_tools.local.supervisor import stop_groups

from .conftest import PUSH_WAIT_S
from .e2e_helpers import (
    BLACK_BG,
    MOONCAKE,
    chat_body,
    chat_ok,
    extra_proxy,
    finished_requests,
    image_source,
    openai_stream,
    post_json,
    push_waits,
    settled_encoder_total,
    text_of,
)
from .media_helpers import image_part, media_body, video_part, video_source

pytestmark = pytest.mark.e2e

fresh = image_source(range(40_000, 50_000))
fresh_video = video_source(range(60_000, 70_000))
# The seed's options: a pixel range of its own for the processor and a black background for RGBA.
SEED_SIZE_KWARGS = {"size": {"shortest_edge": 16384, "longest_edge": 65536}}


def pd_log(st) -> str:
    return st.log_path("pd").read_text(errors="replace")


def test_one_image_is_pushed_to_pd(mooncake_stack, fidelity):
    st = mooncake_stack
    (a,) = fresh(1)
    before = settled_encoder_total(st.encoder_urls)
    body = chat_body([a], logprobs=True, top_logprobs=3)
    got = chat_ok(st.proxy_url, body)
    fidelity.check("one image, default options", got, chat_ok(st.baseline_url, body), path=MOONCAKE)
    assert settled_encoder_total(st.encoder_urls, before + 1) == before + 1
    assert push_waits(st.log_path("pd")) == 0


def test_rgba_with_the_seeds_processing_options(mooncake_stack, fidelity):
    """Encoder and PD process the image alike only if both get `mm_processor_kwargs` and
    `media_io_kwargs`: a mismatch shows as PD refusing the pushed tensor's shape."""
    st = mooncake_stack
    (r,) = fresh(1, mode="RGBA")
    body = chat_body([r], logprobs=True, top_logprobs=2, mm_processor_kwargs=SEED_SIZE_KWARGS, media_io_kwargs=BLACK_BG)
    got = chat_ok(st.proxy_url, body)
    fidelity.check("RGBA PNG, the seed's size + rgba_background_color", got, chat_ok(st.baseline_url, body), MOONCAKE)
    assert "Attempted to assign" not in pd_log(st)
    assert push_waits(st.log_path("pd")) == 0


def test_five_images_with_repeat_over_two_encoders(mooncake_stack, fidelity):
    st = mooncake_stack
    a, b, c, d = fresh(4)
    before = settled_encoder_total(st.encoder_urls)
    body = chat_body([a, b, a, c, d], logprobs=True, top_logprobs=1)
    got = chat_ok(st.proxy_url, body)
    fidelity.check("A B A C D over 2 encoders", got, chat_ok(st.baseline_url, body), path=MOONCAKE)
    # Round robin, images bound for one encoder in one sub-request: one per encoder.
    assert settled_encoder_total(st.encoder_urls, before + 2) == before + 2
    assert push_waits(st.log_path("pd")) == 0


def test_a_video_between_two_images(mooncake_stack, fidelity):
    """The video is a sub-request of its own and the two images one on the other encoder: two
    producers push to the one consumer for one request."""
    st = mooncake_stack
    a, b = fresh(2)
    (v,) = fresh_video(1)
    before = settled_encoder_total(st.encoder_urls)
    body = media_body([image_part(a), video_part(v), image_part(b)], logprobs=True, top_logprobs=2)
    got = chat_ok(st.proxy_url, body)
    fidelity.check("image, video, image", got, chat_ok(st.baseline_url, body), path=MOONCAKE)
    assert settled_encoder_total(st.encoder_urls, before + 2) == before + 2
    assert push_waits(st.log_path("pd")) == 0


def test_an_image_seen_before_is_pushed_again(mooncake_stack, fidelity):
    """No reuse in push mode: each request's transfer ids are its own, so the image is encoded
    and pushed again, and PD (which may still hold it) answers as the baseline does."""
    st = mooncake_stack
    (a,) = fresh(1)
    body = chat_body([a])
    first = chat_ok(st.proxy_url, body)
    before = settled_encoder_total(st.encoder_urls)
    again = chat_ok(st.proxy_url, chat_body([a], text="Describe it again."))
    want = chat_ok(st.baseline_url, chat_body([a], text="Describe it again."))
    fidelity.check("an image of an earlier request", again, want, path=MOONCAKE)
    assert text_of(first) == text_of(chat_ok(st.baseline_url, body))
    assert settled_encoder_total(st.encoder_urls, before + 1) == before + 1
    assert push_waits(st.log_path("pd")) == 0


def test_streaming_openai_client(mooncake_stack, fidelity):
    st = mooncake_stack
    a, b = fresh(2)
    body = chat_body([a, b])
    want = chat_ok(st.baseline_url, body)
    text, usage = openai_stream(st.proxy_url, body)
    same_usage = usage is not None and usage.prompt_tokens == want["usage"]["prompt_tokens"]
    fidelity.record_text("two images, streamed (openai client)", text, text_of(want), same_usage, MOONCAKE)
    assert text == text_of(want) and same_usage


def test_text_only(mooncake_stack, fidelity):
    st = mooncake_stack
    before = settled_encoder_total(st.encoder_urls)
    body = chat_body([], text="Nothing to see over Mooncake.", logprobs=True, top_logprobs=1)
    fidelity.check("text only", chat_ok(st.proxy_url, body), chat_ok(st.baseline_url, body), path=MOONCAKE)
    assert settled_encoder_total(st.encoder_urls) == before


def test_concurrent_requests_each_get_their_own_pushes(mooncake_stack, fidelity):
    """Requests arriving together may share one encoder sub-request (coalescing): each item is
    still pushed under its own request's transfer id, and each answer is its own."""
    st = mooncake_stack
    bodies = [chat_body(fresh(2)) for _ in range(4)]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: chat_ok(st.proxy_url, b), bodies))
    for n, (body, got) in enumerate(zip(bodies, answers)):
        fidelity.check(f"4 concurrent requests, request {n + 1}", got, chat_ok(st.baseline_url, body), MOONCAKE)
    assert push_waits(st.log_path("pd")) == 0


def test_no_encoder_fails_fast_and_never_sends_pd_raw_media(mooncake_stack):
    """With no encoder to take the image, the reference's last resort (PD encodes it) would leave
    a Mooncake PD waiting for a push: the proxy answers at once instead, and PD sees nothing."""
    st = mooncake_stack
    zmq = st.ec_consumer_zmq_addrs()
    dead = ["http://127.0.0.1:9"]  # the discard port: nothing listens there
    with extra_proxy(st, "proxy-no-encoder", "--ec-consumer-zmq-addrs", ",".join(zmq), encoder_urls=dead) as url:
        before = finished_requests(st.pd_url)
        status, data = post_json(url, chat_body(fresh(1)), timeout=PUSH_WAIT_S)
        assert 500 <= status < 600 and isinstance(data, dict) and data.get("error"), (status, data)
        assert finished_requests(st.pd_url) == before
    assert push_waits(st.log_path("pd")) == 0


def test_zy_an_encoder_stopped_mid_run_is_failed_over(mooncake_stack, fidelity):
    """An encoder that refuses the connection received nothing, so its items go to the other
    encoder with the same consumer address. Last of the stack's tests: the encoder stays down."""
    st = mooncake_stack
    stop_groups([st.by_name("encoder-1")], grace=st.config.stop_grace)
    for n in range(2):
        body = chat_body(fresh(1))
        got = chat_ok(st.proxy_url, body)
        fidelity.check(f"encoder-1 stopped, request {n + 1}", got, chat_ok(st.baseline_url, body), MOONCAKE)
    assert push_waits(st.log_path("pd")) == 0


def test_zz_control_a_proxy_that_names_no_consumer_leaves_pd_waiting(mooncake_stack):
    """Without `--ec-consumer-zmq-addrs` the encoder pushes nowhere: PD waits out its push
    timeout and fails the request. So the answers above came over Mooncake, and the wait counter
    the other cases assert 0 can count."""
    st = mooncake_stack
    waited = push_waits(st.log_path("pd"))
    with extra_proxy(st, "proxy-no-consumer", "--decode-retries", "0", encoder_urls=st.encoder_urls[:1]) as url:
        status, data = post_json(url, chat_body(fresh(1)), timeout=PUSH_WAIT_S * 4)
    assert status >= 500, (status, data)
    assert push_waits(st.log_path("pd")) > waited
