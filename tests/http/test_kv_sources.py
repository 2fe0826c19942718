"""Where the proxy finds each engine's KV events (kv_sources.py): asked of every prefill / PD
instance at `/kv_event_sources` as it joins, again as it registers again, or given by
`--kv-events-endpoints`; and what /status.json and /metrics then say. The instances are in-process
fakes answering as vLLM 0.32's route does, the publishers real ZMQ sockets (test_kv_events.py)."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from epd_proxy.fleet.kv_names import chain
from epd_proxy_tools.testing.polling import eventually
from tests.http.test_kv_events import Publisher, prompt, stored
from tests.http.test_status import poll


def vllm_sources(*publishers: Publisher) -> dict:
    """vLLM's answer: its KVEventsConfig per data-parallel rank, bound to `*`."""
    return {
        str(rank): {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{publisher.ports[0]}",
            "replay_endpoint": f"tcp://*:{publisher.ports[1]}",
            "buffer_steps": 10000,
            "hwm": 100000,
            "max_queue_size": 100000,
            "topic": "",
        }
        for rank, publisher in enumerate(publishers)
    }


class Engine:
    """A fake LM instance with only what these tests need: `/health` and `/kv_event_sources`."""

    def __init__(self) -> None:
        self.answer: dict | None = {}  # None: no such route (404)
        self.asked = 0
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/kv_event_sources", self._sources)
        self.server = TestServer(app, host="127.0.0.1")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _sources(self, request: web.Request) -> web.Response:
        self.asked += 1
        if self.answer is None:
            raise web.HTTPNotFound()
        return web.json_response(self.answer)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"


@pytest.fixture
async def engine():
    fake = Engine()
    await fake.server.start_server()
    yield fake
    await fake.server.close()


@pytest.fixture
async def publishers(context):
    made: list[Publisher] = []

    def make() -> Publisher:
        made.append(Publisher(context))
        return made[-1]

    yield make
    for publisher in made:
        await publisher.close()


def kv_row(snapshot: dict, url: str) -> dict | None:
    (row,) = [row for row in snapshot["roster"] if row["url"] == url]
    return row["kv_events"]


async def test_a_registered_instance_is_asked_where_each_rank_publishes_and_followed(make_stack, engine, publishers):
    rank0, rank1 = publishers(), publishers()
    engine.answer = vllm_sources(rank0, rank1)
    await rank0.publish([stored([1, 2], prompt(2, 0))])
    await rank1.publish([stored([5], prompt(1, 900))])
    stack = await make_stack(dynamic=True)
    assert (await stack.register("prefill_decode", engine.url))[0] == 200
    snapshot = await poll(stack, lambda s: (kv_row(s, engine.url) or {}).get("state") == "fresh")
    view = kv_row(snapshot, engine.url)
    assert view["blocks"] == 3 and [e["rank"] for e in view["engines"]] == [0, 1]
    assert all(e["complete"] and e["state"] == "fresh" for e in view["engines"])
    assert snapshot["kv_index"]["blocks"] == 3
    index = stack.state.kv_index
    assert index.prefix_blocks((engine.url, 0), chain(prompt(2, 0))) == 2
    metrics = await stack.metrics()
    assert f'epd_kv_events_state{{instance="{engine.url}",state="fresh"}} 1.0' in metrics
    assert f'epd_kv_index_blocks{{instance="{engine.url}"}} 3.0' in metrics
    assert f'epd_kv_event_batches_total{{instance="{engine.url}"}} 2.0' in metrics
    assert f'epd_kv_event_blocks_total{{change="stored",instance="{engine.url}"}} 3.0' in metrics

    # It leaves: its engines are forgotten.
    assert (await stack.unregister(engine.url))[0] == 200
    await eventually(lambda: index.blocks == 0 and not index.engines())


async def test_registering_again_asks_again_and_follows_where_it_publishes_now(make_stack, engine, publishers):
    before, after = publishers(), publishers()
    engine.answer = vllm_sources(before)
    await before.publish([stored([1], prompt(1, 0))])
    await after.publish([stored([9, 10], prompt(2, 4000))])
    stack = await make_stack(dynamic=True)
    await stack.register("prefill_decode", engine.url)
    await poll(stack, lambda s: (kv_row(s, engine.url) or {}).get("blocks") == 1)
    # It restarted with its publisher elsewhere, and registers again.
    engine.answer = vllm_sources(after)
    await stack.register("prefill_decode", engine.url)
    await poll(stack, lambda s: (kv_row(s, engine.url) or {}).get("blocks") == 2)
    assert engine.asked >= 2


@pytest.mark.parametrize(("answer", "note"), [({}, "publishes no KV events"), (None, "no /kv_event_sources route")])
async def test_an_instance_without_events_is_none_and_says_why(make_stack, engine, answer, note):
    engine.answer = answer
    stack = await make_stack(dynamic=True)
    await stack.register("prefill_decode", engine.url)
    snapshot = await poll(stack, lambda s: (kv_row(s, engine.url) or {}).get("note") == note)
    assert kv_row(snapshot, engine.url)["state"] == "none"
    assert f'epd_kv_events_state{{instance="{engine.url}",state="none"}} 1.0' in await stack.metrics()


async def test_given_endpoints_replace_the_question(make_stack, publishers):
    publisher = publishers()
    await publisher.publish([stored([1, 2, 3], prompt(3, 0))])
    template = f"tcp://{{host}}:{publisher.ports[0]}+tcp://{{host}}:{publisher.ports[1]}"
    stack = await make_stack(kv_events_endpoints=(template,))
    (url,) = stack.backend_urls["d"]
    snapshot = await poll(stack, lambda s: (kv_row(s, url) or {}).get("blocks") == 3)
    assert kv_row(snapshot, url)["note"] == "given by --kv-events-endpoints"
    # Encoders are not language-model engines: they are not followed.
    assert all(kv_row(snapshot, e) is None for e in stack.backend_urls["e"])


async def test_no_kv_events_follows_nothing(make_stack):
    stack = await make_stack(kv_events=False)
    snapshot = await poll(stack, lambda s: True)
    assert snapshot["kv_index"] is None and all(row["kv_events"] is None for row in snapshot["roster"])
    assert stack.state.kv_events is None and "epd_kv_events_state" not in await stack.metrics()
