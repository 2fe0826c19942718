"""Proxy (2 encoders + PD) vs a single plain vLLM instance, on real vLLM.

Tests run in file order; the negative control is last because it can kill
PD's engine (the autouse fixture in conftest.py restarts PD if anything
runs after it).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import urllib.request

import blake3
import pytest

from epd_proxy_tools.testing.polling import eventually_sync

from .e2e_helpers import (
    BLACK_BG,
    LOWERCASE_IDS,
    MODEL,
    SMALL_SIZE_KWARGS,
    chat_body,
    chat_ok,
    comparable,
    encoder_total,
    extra_proxy,
    image_source,
    loaded_hashes,
    media_body,
    metric_total,
    post_json,
    settled_encoder_total,
    store_entries,
    text_of,
)

pytestmark = pytest.mark.e2e

# Distinct seed ranges per test: PD keeps embeddings and prefixes it has seen
# in memory, so reusing a picture would let PD answer without touching the
# EC store and weaken the "encoder did the work" checks.
fresh = image_source(range(100, 10_000))


def assert_same(proxy_resp: dict, base_resp: dict) -> None:
    assert comparable(proxy_resp) == comparable(base_resp)


# ---------------------------------------------------------------- sensitivity
def test_baseline_is_sensitive_to_inputs(stack):
    """Without this, an exact-match test could not detect a wrong image."""
    base = stack.baseline_url
    a, b = fresh(2)
    r = fresh(1, mode="RGBA")[0]
    ans = {
        "A": text_of(chat_ok(base, chat_body([a]))),
        "B": text_of(chat_ok(base, chat_body([b]))),
        "AB": text_of(chat_ok(base, chat_body([a, b]))),
        "BA": text_of(chat_ok(base, chat_body([b, a]))),
        "A small": text_of(chat_ok(base, chat_body([a], mm_processor_kwargs=SMALL_SIZE_KWARGS))),
        "R": text_of(chat_ok(base, chat_body([r]))),
        "R black": text_of(chat_ok(base, chat_body([r], media_io_kwargs=BLACK_BG))),
        "text": text_of(chat_ok(base, chat_body([]))),
    }
    for x, y in [("A", "B"), ("AB", "BA"), ("A", "A small"), ("R", "R black"), ("A", "text")]:
        assert ans[x] != ans[y], f"baseline answers {x!r} and {y!r} are both {ans[x]!r}"
    # Greedy decoding must be repeatable, or exact comparison is meaningless.
    assert text_of(chat_ok(base, chat_body([a]))) == ans["A"]
    assert all(set(t) <= set("abcdefghijklmnopqrstuvwxyz") for t in ans.values())


# ------------------------------------------------------------------ fidelity
def test_one_image_default_options(stack, fidelity):
    (a,) = fresh(1)
    before_store = store_entries(stack.ec_store)
    before_enc = encoder_total(stack.encoder_urls)
    body = chat_body([a], logprobs=True, top_logprobs=3)
    got = chat_ok(stack.proxy_url, body)
    want = chat_ok(stack.baseline_url, body)
    fidelity.check("one image, default options", got, want)
    assert got["choices"][0]["logprobs"]["content"], "logprobs were requested"
    assert settled_encoder_total(stack.encoder_urls, before_enc + 1) == before_enc + 1

    new = {h: ok for h, ok in store_entries(stack.ec_store).items() if h not in before_store}
    assert len(new) == 1 and all(new.values()), new
    assert set(new) <= set(loaded_hashes(stack.log_path("pd"))), "PD did not load E's embedding"


def test_rgba_with_processing_options(stack, fidelity):
    """Non-default size (other grid) + RGBA background: derived engine hashes."""
    (r,) = fresh(1, mode="RGBA")
    before_store = store_entries(stack.ec_store)
    opts = dict(mm_processor_kwargs=SMALL_SIZE_KWARGS, media_io_kwargs=BLACK_BG)
    body = chat_body([r], logprobs=True, top_logprobs=2, **opts)
    got = chat_ok(stack.proxy_url, body)
    want = chat_ok(stack.baseline_url, body)
    fidelity.check("RGBA PNG, size + rgba_background_color", got, want)
    # The grid really is the small one: 12 image tokens instead of 48.
    default = chat_ok(stack.baseline_url, chat_body([r], media_io_kwargs=BLACK_BG))
    assert got["usage"]["prompt_tokens"] == default["usage"]["prompt_tokens"] - 36

    new = {h: ok for h, ok in store_entries(stack.ec_store).items() if h not in before_store}
    assert len(new) == 1 and all(new.values()), new
    url_hash = hashlib.sha256(r.encode()).hexdigest()
    assert url_hash not in new, "options must change the engine hash"
    assert set(new) <= set(loaded_hashes(stack.log_path("pd")))


@pytest.mark.parametrize("options", [{}, {"mm_processor_kwargs": SMALL_SIZE_KWARGS}], ids=["default", "small-size"])
def test_five_images_with_repeat_over_two_encoders(stack, fidelity, options):
    a, b, c, d = fresh(4)
    images = [a, b, a, c, d]
    before_store = store_entries(stack.ec_store)
    before_enc = settled_encoder_total(stack.encoder_urls)
    body = chat_body(images, logprobs=True, top_logprobs=1, **options)
    got = chat_ok(stack.proxy_url, body)
    after_enc = settled_encoder_total(stack.encoder_urls, before_enc + 2)
    want = chat_ok(stack.baseline_url, body)
    fidelity.check(f"A B A C D over 2 encoders, {'size option' if options else 'default options'}", got, want)
    # Round robin over 2 encoders, no batch cap: one sub-request per encoder.
    assert after_enc - before_enc == 2

    new = {h: ok for h, ok in store_entries(stack.ec_store).items() if h not in before_store}
    assert len(new) == 4, f"expected one EC entry per distinct image, got {sorted(new)}"
    assert all(new.values()), f"empty store folders (consumer misses): {new}"
    assert set(new) <= set(loaded_hashes(stack.log_path("pd"))), "PD encoded by itself"


def test_blake3_media_names_match_the_baseline(stack, fidelity):
    """`--media-hash blake3`: E stores and PD loads each embedding under the blake3 name, and the
    answer is the baseline's (one image repeated, so the in-request dedup holds too)."""
    a, b = fresh(2)
    before_store = store_entries(stack.ec_store)
    body = chat_body([a, b, a], logprobs=True, top_logprobs=2)
    with extra_proxy(stack, "blake3-proxy", "--media-hash", "blake3") as url:
        got = chat_ok(url, body)
    want = chat_ok(stack.baseline_url, body)
    fidelity.check("A B A, --media-hash blake3", got, want)
    new = {h: ok for h, ok in store_entries(stack.ec_store).items() if h not in before_store}
    assert set(new) == {blake3.blake3(x.encode()).hexdigest() for x in (a, b)} and all(new.values()), new
    assert set(new) <= set(loaded_hashes(stack.log_path("pd"))), "PD did not load E's embeddings"


def test_streaming_through_proxy_matches(stack, fidelity):
    from openai import OpenAI

    a, b = fresh(2)
    body = chat_body([a, b])
    want = chat_ok(stack.baseline_url, body)
    client = OpenAI(base_url=stack.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    extra = {k: body[k] for k in ("allowed_token_ids",)}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=body["messages"],
        temperature=0,
        seed=body["seed"],
        max_tokens=body["max_tokens"],
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta and ch.delta.content:
                pieces.append(ch.delta.content)
            if ch.finish_reason:
                finish = ch.finish_reason
    fidelity.record_text(
        "two images, streamed (openai client)",
        "".join(pieces),
        text_of(want),
        usage is not None and usage.prompt_tokens == want["usage"]["prompt_tokens"],
    )
    assert "".join(pieces) == text_of(want)
    assert finish == want["choices"][0]["finish_reason"]
    assert usage is not None
    assert usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert usage.completion_tokens == want["usage"]["completion_tokens"]


def status(url: str) -> dict:
    with urllib.request.urlopen(url.rstrip("/") + "/status.json", timeout=30) as resp:
        return json.loads(resp.read())


def raw_stream(url: str, body: dict) -> list[dict]:
    """The events of a chat stream as vLLM (or the proxy) wrote them, [DONE] as None."""
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        raw = resp.read()
    assert raw.endswith(b"\n\n"), raw[-200:]
    data = [event.removeprefix(b"data: ") for event in raw.split(b"\n\n")[:-1]]
    return [None if d == b"[DONE]" else json.loads(d) for d in data]


def test_a_stream_without_usage_asked_is_relayed_as_vllm_writes_it_while_the_proxy_hears_its_usage(stack, fidelity):
    """The proxy asks PD for usage on the client's behalf (prefix_affinity learns prompt sizes
    from it): the client still gets vLLM's stream without usage, the fingerprint where vLLM puts it.
    How vLLM cuts the text into chunks depends on how fast its reader is, so the text is compared
    whole, and the first and the finishing chunk field by field."""
    (a,) = fresh(1)
    body = chat_body([a], stream=True)
    heard = status(stack.proxy_url)["prompt_size"]["answers_heard"]
    got, want = raw_stream(stack.proxy_url, body), raw_stream(stack.baseline_url, body)
    assert status(stack.proxy_url)["prompt_size"]["answers_heard"] == heard + 1
    own = raw_stream(stack.pd_url, media_body([], stream=True))[-2]["system_fingerprint"]

    def text(events: list) -> str:
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e and e["choices"])

    def shape(event: dict) -> list:
        # Ids and times differ between servers; the fingerprint hashes each server's own config;
        # the finishing chunk may carry the last tokens, however they were cut.
        return [
            (k, "-" if k in ("id", "created", "system_fingerprint") else v) for k, v in event.items() if k != "choices"
        ] + [[{k: v for k, v in c.items() if k != "delta"} for c in event["choices"]]]

    assert got[-1] is None and want[-1] is None  # [DONE]
    assert text(got) == text(want)
    assert shape(got[0]) == shape(want[0]) and shape(got[-2]) == shape(want[-2])
    assert got[-2]["choices"][0]["finish_reason"] == want[-2]["choices"][0]["finish_reason"]
    assert got[-2]["system_fingerprint"] == own and all("usage" not in e for e in got if e)
    fidelity.record_text("one image, streamed without usage", text(got), text(want), True)


def test_text_only_skips_encoders(stack, fidelity):
    before = settled_encoder_total(stack.encoder_urls)
    body = chat_body([], text="Say something about nothing.", logprobs=True, top_logprobs=2)
    got = chat_ok(stack.proxy_url, body)
    want = chat_ok(stack.baseline_url, body)
    fidelity.check("text only", got, want)
    time.sleep(0.5)
    assert settled_encoder_total(stack.encoder_urls) == before


def test_single_image_requests_rotate_over_encoders(stack):
    """Consecutive one-image requests must not all land on encoder 0."""
    from .e2e_helpers import finished_requests

    before = [finished_requests(u) for u in stack.encoder_urls]
    for img in fresh(2):
        chat_ok(stack.proxy_url, chat_body([img]))
    settled_encoder_total(stack.encoder_urls, sum(before) + 2)
    after = [finished_requests(u) for u in stack.encoder_urls]
    assert [a - b for a, b in zip(after, before)] == [1, 1]


def test_concurrent_requests_do_not_mix(stack):
    """Interleaved requests with different images each get their own answer."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [chat_body([img]) for img in fresh(3)]
    bodies += [chat_body([img]) for img in fresh(2, fmt="JPEG")]
    bodies += [chat_body(fresh(3)), chat_body(fresh(2), mm_processor_kwargs=SMALL_SIZE_KWARGS)]
    want = [comparable(chat_ok(stack.baseline_url, b)) for b in bodies]
    assert len({text_of_c(w) for w in want}) > 1
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        got = list(pool.map(lambda b: comparable(chat_ok(stack.proxy_url, b)), bodies))
    assert got == want


def text_of_c(c: dict) -> str:
    return c["choices"][0]["message"]["content"]


def _bypasses(url: str, a_hash: str) -> list[dict]:
    """Parts vLLM's chat parser reads as embeddings or cache references (by their keys when there is
    no type or when a uuid is present), or that name two kinds. Each one used to reach PD."""
    grid = {"image_grid_thw": [1, 6, 8]}
    return [
        {"image_embeds": grid, "uuid": "0000deadbeef"},
        {"type": "image_embeds", "image_embeds": grid, "uuid": "f" * 64},
        {"type": "", "image_embeds": grid},
        {"type": "text", "text": "x", "image_embeds": grid, "uuid": a_hash},
        {"type": "text", "text": "x", "image_url": {"url": url}, "uuid": a_hash},
        {"type": None, "image_embeds": grid, "uuid": a_hash},
        {"image_pil": None, "uuid": a_hash},
        {"image_url": None, "uuid": a_hash},
        {"audio_embeds": {"audio_feature_lengths": [4]}, "uuid": "x"},
        {"type": "prompt_embeds", "data": "AAAA"},
    ]


def test_proxy_refuses_every_reference_bypass_and_pd_survives(stack):
    """Each bypass gets a 4xx from the proxy, PD's engine stays alive, and the next normal request
    still matches the baseline exactly."""
    from epd_proxy_tools.local.supervisor import http_ok

    a, b = fresh(2)
    before = store_entries(stack.ec_store)
    chat_ok(stack.proxy_url, chat_body([a]))  # publishes A's embedding: a real hash to aim at
    [a_hash] = [h for h, ok in store_entries(stack.ec_store).items() if ok and h not in before]
    for part in _bypasses(b, a_hash):
        body = chat_body([])
        body["messages"][0]["content"].append(part)
        status, data = post_json(stack.proxy_url, body)
        assert 400 <= status < 500, (part, status, data)
    bogus = "f" * 64
    status, data = post_json(stack.proxy_url, chat_body([b], ec_transfer_params={bogus: {"metadata": {}}}))
    assert 400 <= status < 500, (status, data)
    assert http_ok(stack.by_name("pd").health_url), "PD died"
    assert_same(chat_ok(stack.proxy_url, chat_body([b])), chat_ok(stack.baseline_url, chat_body([b])))


def test_client_uuid_cannot_alias_another_image(stack):
    """A client uuid naming another picture's EC entry is dropped: the answer is the sent image's."""
    a, b = fresh(2)
    before = store_entries(stack.ec_store)
    chat_ok(stack.proxy_url, chat_body([a]))  # publishes A's embedding
    new = [h for h, ok in store_entries(stack.ec_store).items() if ok and h not in before]
    assert len(new) == 1, new
    a_hash = new[0]
    want_b = chat_ok(stack.baseline_url, chat_body([b]))
    want_a = chat_ok(stack.baseline_url, chat_body([a]))
    assert text_of(want_a) != text_of(want_b)
    for part in ({"type": "image_url", "image_url": {"url": b}}, {"image_url": {"url": b}}):
        body = chat_body([])
        body["messages"][0]["content"].append({**part, "uuid": a_hash})
        assert_same(chat_ok(stack.proxy_url, body), want_b)


# ------------------------------------------- encoder failover (stops encoder-1)
def _proxy_health(proxy_url: str) -> dict:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(proxy_url + "/health", timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:  # 503 still carries the body
        return json.loads(err.read())


# The proxy's default --ejection-time: a restarted encoder must be back in rotation within it.
EJECTION_TIME_S = 30.0


def test_zy_encoder_stopped_mid_run_fails_over_and_rejoins_after_restart(stack):
    """One of two encoders dies during a run: every request still succeeds with the baseline's
    exact answer, and the proxy's /metrics count the failovers; the proxy takes it out of rotation.
    Started again on the same port, it gets encoder sub-requests again within the ejection time."""
    from concurrent.futures import ThreadPoolExecutor

    from epd_proxy_tools.local.supervisor import stop_groups

    from .e2e_helpers import finished_requests

    images = fresh(16)
    bodies = [chat_body([img]) for img in images[:6]] + [chat_body(images[6:8])]
    after_restart = [chat_body([img]) for img in images[8:]]
    wanted = [chat_ok(stack.baseline_url, b) for b in bodies]
    wanted_after = [chat_ok(stack.baseline_url, b) for b in after_restart]
    before = metric_total(stack.proxy_url, "epd_encoder_failovers_total")
    victim_url = stack.encoder_urls[1]

    assert_same(chat_ok(stack.proxy_url, bodies[0]), wanted[0])
    victim = stack.by_name("encoder-1")
    stop_groups([victim], grace=10)
    try:
        # Right after the stop, before any health check notices: single-image requests rotate
        # over both encoders, so some land on the dead one and must fail over.
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda b: post_json(stack.proxy_url, b), bodies[1:]))
        for (status, data), want in zip(results, wanted[1:]):
            assert status == 200, data
            assert_same(data, want)
        assert metric_total(stack.proxy_url, "epd_encoder_failovers_total") > before
        # Transport failures eject it, or three failed checks call it down (checks every 5 s).
        eventually_sync(
            lambda: not _proxy_health(stack.proxy_url)["instances"][victim_url]["in_rotation"],
            timeout=60,
            interval=0.5,
            what="the stopped encoder leaves the rotation",
        )
        status, data = post_json(stack.proxy_url, after_restart[0])
        assert status == 200, data
        assert_same(data, wanted_after[0])
    finally:
        stack.restart("encoder-1")
    restarted = time.monotonic()
    for body, want in zip(after_restart[1:], wanted_after[1:]):
        assert_same(chat_ok(stack.proxy_url, body), want)
        last_answered = time.monotonic()
        if finished_requests(victim_url):
            break
        time.sleep(1.0)
    # vLLM bumps its counter a moment after answering: allow that for the last request sent.
    eventually_sync(lambda: finished_requests(victim_url) >= 1, interval=0.5, what="the restarted encoder serves")
    elapsed = last_answered - restarted
    sys.stderr.write(f"\n[e2e] restarted encoder served again {elapsed:.1f} s after it was ready\n")
    assert elapsed < EJECTION_TIME_S, f"back in rotation only after {elapsed:.1f}s"
    view = _proxy_health(stack.proxy_url)["instances"][victim_url]
    assert view["in_rotation"], view


# ------------------------------------------------------ negative control, LAST
def test_zz_negative_control_options_not_forwarded(stack):
    """The pre-fix proxy behaviour (options dropped on the way to E) must fail.

    E stores the embedding under the bare uuid; PD derives uuid+options and
    finds nothing.  If this ever passed, the fidelity tests above would not
    be able to catch the bug they exist for.
    """
    (x,) = fresh(1, mode="RGBA")
    opts = dict(mm_processor_kwargs=SMALL_SIZE_KWARGS, media_io_kwargs=BLACK_BG)
    want = chat_ok(stack.baseline_url, chat_body([x], **opts))

    uuid = hashlib.sha256(x.encode()).hexdigest()
    enc_body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": x}, "uuid": uuid}]}],
        "stream": False,
    }
    enc = chat_ok(stack.encoder_urls[0], enc_body)
    params = enc.get("ec_transfer_params") or {}
    assert list(params) == [uuid], params
    meta = {
        k: [v for row in val for v in row] if val and isinstance(val[0], list) else val
        for k, val in params[uuid]["metadata"].items()
    }
    pd_body = chat_body([], **opts)
    pd_body["messages"][0]["content"].append({"type": "image_embeds", "image_embeds": meta, "uuid": uuid})
    pd_body["allowed_token_ids"] = LOWERCASE_IDS
    status, data = post_json(stack.pd_url, pd_body, timeout=60)
    if status == 200:
        assert text_of(data) != text_of(want), "stale embedding produced the right answer?"
    else:
        assert status >= 500, f"unexpected HTTP {status}: {data}"
