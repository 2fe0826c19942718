"""Conversations on real vLLM (docs/prefix-routing.md): over two PDs and over E+P+D, each turn
adding one image and re-sending the history, every turn's answer must equal the single plain
instance's, also after the EC store was emptied between turns and after the consumer lost its
prefix cache (then it encodes the history itself). vLLM's own counters show where the work went:
one image per turn at the encoders, and the history's KV reused on the conversation's PD."""

from __future__ import annotations

import shutil
import urllib.request

from epd_proxy_tools.bench.engines import parse_metrics
from epd_proxy_tools.testing.harness import free_port

from .e2e_helpers import (
    LOWERCASE_IDS,
    MODEL,
    PREFILL,
    TWO_PDS,
    chat_ok,
    extra_proxy,
    image_source,
    metric_total,
    settled_encoder_total,
)

fresh = image_source(range(7000, 7100))
TURNS = 4


def turn_bodies(images: list[str], **extra) -> list[dict]:
    """Turn n's body: every earlier turn with a fixed reply, then turn n's text and image."""
    messages: list[dict] = [{"role": "system", "content": "You look at screens."}]
    bodies = []
    for n, url in enumerate(images):
        if n:
            messages.append({"role": "assistant", "content": "noted"})
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"Step {n}: describe it."},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        )
        bodies.append(
            {
                "model": MODEL,
                "messages": list(messages),
                "temperature": 0,
                "seed": 1234,
                "max_tokens": 8,
                "allowed_token_ids": LOWERCASE_IDS,
                **extra,
            }
        )
    return bodies


def counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode())


def empty_store(store) -> None:
    for entry in store.iterdir():
        shutil.rmtree(entry, ignore_errors=True)


def reset_prefix_cache(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST"), timeout=30)


def converse(
    st, fidelity, path: str, case: str, consumers: list[str], between=None, proxy_url: str = "", encoded_per_turn=1
) -> list[dict]:
    """One conversation through the proxy (the stack's, or `proxy_url`), each turn checked against
    the baseline; `between(n)` runs before turn n. Returns the consumers' counters before and after."""
    bodies = turn_bodies(fresh(TURNS))
    before = {url: counters(url) for url in consumers}
    encoded = settled_encoder_total(st.encoder_urls)
    for n, body in enumerate(bodies):
        if between is not None:
            between(n)
        answer = chat_ok(proxy_url or st.proxy_url, body)
        fidelity.check(f"{case}, turn {n + 1}", answer, chat_ok(st.baseline_url, body), path)
    # One encoder sub-request per turn: the history was not sent to an encoder again.
    expected = encoded + encoded_per_turn * TURNS
    assert settled_encoder_total(st.encoder_urls, expected) == expected
    return [before, {url: counters(url) for url in consumers}]


def grew(before: dict, after: dict, url: str, name: str) -> float:
    return after[url].get(name, 0.0) - before[url].get(name, 0.0)


def test_a_conversation_over_two_pds_stays_on_one_and_reuses_its_prefix(two_pd_stack, fidelity):
    st = two_pd_stack
    before, after = converse(st, fidelity, TWO_PDS, "agent steps over 2 PDs", st.consumer_urls)
    served = {url: grew(before, after, url, "requests") for url in st.consumer_urls}
    assert sorted(served.values()) == [0.0, TURNS], served
    home = max(served, key=served.get)
    assert grew(before, after, home, "prefix_hits") > 0, "later turns reused the earlier turns' KV"


def test_over_two_pds_an_emptied_ec_store_and_a_lost_prefix_still_give_exact_answers(two_pd_stack, fidelity):
    st = two_pd_stack

    def between(n: int) -> None:
        if n == 2:
            empty_store(st.ec_store)
        if n == 3:
            empty_store(st.ec_store)
            for url in st.consumer_urls:
                reset_prefix_cache(url)

    converse(st, fidelity, TWO_PDS, "EC store emptied, then prefix lost", st.consumer_urls, between)


def test_over_epd_the_prefill_reuses_its_prefix_and_survives_an_emptied_store(prefill_stack, fidelity):
    st = prefill_stack

    def between(n: int) -> None:
        if n == 2:
            empty_store(st.ec_store)

    before, after = converse(st, fidelity, PREFILL, "agent steps, EC store emptied", [st.prefill_url], between)
    assert grew(before, after, st.prefill_url, "prefix_hits") > 0


def test_with_every_encoder_stopped_a_conversation_over_two_pds_is_still_exact(two_pd_stack, fidelity):
    """No encoder answers (nothing listens at their addresses): each turn's media go raw to the PD,
    which encodes the new image itself and finds the history in its prefix cache."""
    st = two_pd_stack
    stopped = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    decode = ",".join(st.consumer_urls)
    with extra_proxy(st, "encoders-stopped-proxy", encoder_urls=stopped, decode_url=decode) as url:
        before, after = converse(
            st, fidelity, TWO_PDS, "every encoder stopped", st.consumer_urls, proxy_url=url, encoded_per_turn=0
        )
        encoded, reused = (
            metric_total(url, name) for name in ("epd_items_consumer_encoded_total", "epd_items_reused_total")
        )

    # Each turn's new image was encoded by its PD; the history it held went raw as reused.
    assert (encoded, reused) == (TURNS, sum(range(TURNS)))
    served = {pd: grew(before, after, pd, "requests") for pd in st.consumer_urls}
    assert sorted(served.values()) == [0.0, TURNS], served
