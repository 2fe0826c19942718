"""Placement and reuse from the engines' own KV events, through the proxy against two fake PDs
that publish them (fake_kv_events.py): a new proxy process, whose record is empty, sends a
conversation's next turn where its prefix is and does not encode what that PD holds; after the PD
restarts, an image the record knows only as sent there is encoded again by an encoder."""

from __future__ import annotations

import time

from epd_proxy.fleet.backends import PREFILL_DECODE
from epd_proxy.fleet.kv_names import media_key
from epd_proxy.fleet.routing import PrefixAffinity
from epd_proxy.journey.doors import CHAT
from epd_proxy.journey.extract import normalise_request
from epd_proxy.journey.held import INDEX_CATCH_UP_S
from epd_proxy.journey.reuse import conversation_key
from epd_proxy_tools.testing.fake_kv_events import KvEventsOptions
from epd_proxy_tools.testing.polling import eventually
from tests.http.test_reuse import content_of, total, turn_body

OPTIONS = KvEventsOptions(block_size=8, num_blocks=512)


def uuid_of(conv: int, turn: int) -> str:
    return normalise_request(turn_body(conv, turn)).items[turn].uuid


def engines_fresh(stack, urls) -> bool:
    return all(stack.state.kv_index.state((url, 0)) == "fresh" for url in urls)


def decisions(stack, decision: str, source: str) -> float:
    sample = stack.state.metrics.registry.get_sample_value(
        "epd_prefix_decisions_total", {"decision": decision, "source": source}
    )
    return sample or 0.0


async def two_proxies(make_stack, pds: int):
    """A proxy over one encoder and `pds` PDs publishing KV events, and a second proxy process
    over the same fakes (its record empty), both following the PDs' events."""
    first = await make_stack(
        encoders=1, decoders=pds, consumer_options={"kv_events": OPTIONS}, kv_events_stale_after_s=1.5
    )
    second = await make_stack(
        encoders=0,
        decoders=0,
        fakes=first.fakes,
        encode_urls=tuple(first.backend_urls["e"]),
        decode_urls=tuple(first.backend_urls["d"]),
        kv_events_stale_after_s=1.5,
    )
    urls = first.backend_urls["d"]
    for stack in (first, second):
        await eventually(lambda s=stack: engines_fresh(s, urls), timeout=20, what="the PDs' KV events never fresh")
    return first, second


async def holds(stack, url: str, conv: int, turn: int) -> None:
    await eventually(
        lambda: (stack.state.kv_index.media_prefix((url, 0), uuid_of(conv, turn)) or 0) > 0,
        timeout=20,
        what=f"the index never saw turn {turn}'s image on {url}",
    )


async def test_a_new_proxy_sends_the_next_turn_where_the_index_says_its_prefix_is_and_does_not_encode_it(make_stack):
    first, second = await two_proxies(make_stack, pds=2)
    urls = first.backend_urls["d"]
    pds = dict(zip(urls, first.consumers))
    # Where the hash sends this conversation; turn 0 runs on the other PD, the home being busy.
    members = second.state.fleet.members(PREFILL_DECODE)
    parsed = normalise_request(turn_body(0, 1))
    key = conversation_key(parsed.body.get("model"), CHAT.conversation(parsed.body), parsed.items)
    home = PrefixAffinity().choose(members, [key])[0].url
    (other,) = [url for url in urls if url != home]
    busy = next(m for m in first.state.fleet.members(PREFILL_DECODE) if m.url == home)
    busy.prefill_queue = 1e6
    await content_of(first, turn_body(0, 0))
    busy.prefill_queue = 0.0
    assert len(pds[other].requests) == 1 and not pds[home].requests
    await holds(second, other, 0, 0)

    encoded = total(first.encoders, "images")
    await content_of(second, turn_body(0, 1))
    assert len(pds[other].requests) == 2 and not pds[home].requests
    assert total(first.encoders, "images") == encoded + 1  # turn 1's own image alone
    assert pds[other].encoded_locally == 0 and sum(pds[other].counts.prefix_items.values()) == 1
    assert decisions(second, "placement", "index") == 1 and decisions(second, "reuse", "index") == 1
    metrics = await second.metrics()
    assert 'epd_prefix_decisions_total{decision="placement",source="index"} 1.0' in metrics


async def test_after_the_pd_restarts_an_image_known_only_as_sent_there_is_encoded_again(make_stack):
    first, second = await two_proxies(make_stack, pds=1)
    (url,), (pd,) = first.backend_urls["d"], first.consumers
    await content_of(first, turn_body(0, 0))
    await holds(second, url, 0, 0)
    # The second process takes turn 0's image from the PD's prefix: it knows it as sent there only.
    await content_of(second, turn_body(0, 1))
    await holds(second, url, 0, 1)
    sent = time.monotonic()
    pd.restart_engine()
    # The index overrules what the proxy sent only once it caught up with the PD well after the
    # send (held.INDEX_CATCH_UP_S): its heartbeat replays bring that moment.
    await eventually(
        lambda: (
            second.state.kv_index.size((url, 0)) == 0
            and engines_fresh(second, [url])
            and (second.state.kv_index.heard_at((url, 0)) or 0.0) > sent + INDEX_CATCH_UP_S
        ),
        timeout=30,
        what="the second proxy never caught up with the restarted PD",
    )
    encoded = total(first.encoders, "images")
    await content_of(second, turn_body(0, 2))
    # Turn 0's image again, by an encoder, and turn 2's; turn 1's was seen encoded: the PD loads
    # it from the EC store.
    assert total(first.encoders, "images") == encoded + 2
    assert pd.encoded_locally == 0
    assert decisions(second, "encode_again", "index") == 1


async def test_an_image_the_pd_holds_in_an_adapters_blocks_is_encoded_for_the_base_model(make_stack):
    # vLLM keys every block of a LoRA request with the adapter's name: a base-model prompt through
    # the same image reuses none of them, so the image goes to an encoder (this proxy never saw it
    # encoded), not raw to a PD that would have to encode it itself.
    first = await make_stack(
        encoders=1,
        decoders=1,
        consumer_options={"kv_events": OPTIONS, "lora_modules": ("ada",)},
        kv_events_stale_after_s=1.5,
    )
    second = await make_stack(
        encoders=0,
        decoders=0,
        fakes=first.fakes,
        encode_urls=tuple(first.backend_urls["e"]),
        decode_urls=tuple(first.backend_urls["d"]),
        kv_events_stale_after_s=1.5,
    )
    (url,), (pd,) = first.backend_urls["d"], first.consumers
    await eventually(lambda: engines_fresh(second, [url]), timeout=20, what="the PD's KV events never fresh")
    await content_of(first, {**turn_body(0, 0), "model": "ada"})
    index = second.state.kv_index
    await eventually(
        lambda: (index.media_prefix((url, 0), media_key(uuid_of(0, 0), "ada")) or 0) > 0,
        timeout=20,
        what="the index never saw the adapter's turn",
    )
    assert index.media_prefix((url, 0), uuid_of(0, 0)) == 0

    encoded = total(first.encoders, "images")
    await content_of(second, turn_body(0, 1))
    assert total(first.encoders, "images") == encoded + 2  # turn 0's image again, and turn 1's
    assert pd.encoded_locally == 0 and decisions(second, "reuse", "index") == 0
    # The adapter's next turn takes turn 0's image from the adapter's blocks.
    await holds(second, url, 0, 1)
    encoded = total(first.encoders, "images")
    await content_of(second, {**turn_body(0, 1), "model": "ada"})
    assert total(first.encoders, "images") == encoded + 1 and decisions(second, "reuse", "index") == 1
