"""A render server asked for a request's prompt before placement (render.py): what it is sent, and
that nothing it does can fail the request."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from epd_proxy.calls.upstream import CONNECT_TIMEOUT
from epd_proxy.config import Config
from epd_proxy.fleet.health import Health
from epd_proxy.fleet.registry import Registry
from epd_proxy.fleet.rendered import Item
from epd_proxy.journey.doors import CHAT
from epd_proxy.journey.extract import normalise_request
from epd_proxy.journey.messages_api import MESSAGES
from epd_proxy.journey.render import MAX_INFLIGHT, REST_S, Renderer
from epd_proxy.journey.route import ClientBody
from epd_proxy.ops.metrics import Metrics
from tests.media import chat, image
from tests.unit.scripted_upstream import Reply, ScriptedUpstream, json_reply

R1, R2 = "http://render-1", "http://render-2"
RENDERED = {
    "token_ids": [5, 6, 7, 8],
    "features": {"mm_hashes": {"image": ["u1"]}, "mm_placeholders": {"image": [{"offset": 1, "length": 2}]}},
}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def renderer(upstream, urls=(R1, R2 + "/"), clock=None) -> tuple[Renderer, Metrics]:
    config = Config(encode_urls=("http://e",), decode_urls=("http://pd",))
    fleet = Registry.from_config(config)
    metrics = Metrics(fleet, Health())
    return Renderer(upstream, urls, metrics, clock=clock or Clock()), metrics


def counted(metrics: Metrics, outcome: str) -> float:
    registry: CollectorRegistry = metrics.registry
    return registry.get_sample_value("epd_render_total", {"outcome": outcome}) or 0.0


async def test_the_consumers_body_with_every_item_raw_under_its_name_is_rendered_without_tensors():
    upstream = ScriptedUpstream()
    upstream.script(R1, json_reply(RENDERED))
    upstream.script(R2, json_reply(RENDERED))
    render, metrics = renderer(upstream)
    body = chat(image("a"), stream=True)
    job = ClientBody(body, normalise_request(body).items)
    first = await render.render(job, CHAT)
    assert first is not None and list(first.tokens) == [5, 6, 7, 8] and first.items == [Item("u1", 1, 2)]
    await render.render(job, CHAT)
    (one,), (_,) = upstream.to(R1), upstream.to(R2)  # the servers in turn
    assert (one.method, one.path, one.stage) == ("POST", "/v1/chat/completions/render", "render")
    assert one.body["mm_payload"] == "none"
    (part,) = [p for p in one.body["messages"][0]["content"] if p["type"] == "image_url"]
    assert part["uuid"] == job.items[0].uuid and part["image_url"] == body["messages"][0]["content"][1]["image_url"]
    assert "mm_payload" not in body  # the client's body is not changed
    assert counted(metrics, "rendered") == 2


async def test_each_door_renders_at_its_own_path():
    upstream = ScriptedUpstream()
    upstream.script(R1, json_reply(RENDERED))
    render, _ = renderer(upstream)
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    await render.render(ClientBody(body), MESSAGES)
    assert upstream.sent[0].path == "/v1/messages/render"


@pytest.mark.parametrize(
    "reply",
    [
        json_reply({"error": {"message": "Scale-out endpoints are disabled."}}, 403),
        json_reply({"token_ids": [1, -1]}),
        Reply(200, (b"<html>",)),
        Reply(fails=CONNECT_TIMEOUT),
    ],
)
async def test_a_render_that_fails_or_lies_leaves_the_prompt_unrendered_and_is_counted(reply):
    upstream = ScriptedUpstream()
    upstream.script(R1, reply)
    render, metrics = renderer(upstream)
    body = chat(image("a"))
    assert await render.render(ClientBody(body, normalise_request(body).items), CHAT) is None
    assert counted(metrics, "failed") == 1


async def test_a_job_already_let_go_is_not_rendered():
    render, _ = renderer(ScriptedUpstream())
    assert await render.render(ClientBody(None), CHAT) is None


async def test_a_server_that_failed_is_left_alone_for_a_while_but_a_request_it_refused_is_its_own():
    upstream, clock = ScriptedUpstream(), Clock()
    upstream.script(R1, Reply(fails=CONNECT_TIMEOUT), json_reply({"error": {"message": "no such model"}}, 404))
    upstream.script(R1, json_reply(RENDERED), json_reply(RENDERED))
    render, metrics = renderer(upstream, (R1,), clock)
    body = chat(image("a"))
    job = ClientBody(body, normalise_request(body).items)
    assert await render.render(job, CHAT) is None
    # Down: the next requests are placed at once, without waiting out another timeout.
    assert await render.render(job, CHAT) is None and len(upstream.sent) == 1
    assert counted(metrics, "skipped") == 1
    clock.now += REST_S
    assert await render.render(job, CHAT) is None  # a 404: this request's, not the server's
    assert await render.render(job, CHAT) is not None
    assert counted(metrics, "failed") == 2 and counted(metrics, "rendered") == 1


async def test_a_server_with_many_renders_in_flight_is_not_asked():
    upstream = ScriptedUpstream()
    render, metrics = renderer(upstream, (R1,))
    body = chat(image("a"))
    next(render._turn).inflight = MAX_INFLIGHT
    assert await render.render(ClientBody(body, normalise_request(body).items), CHAT) is None
    assert not upstream.sent and counted(metrics, "skipped") == 1


async def test_a_resting_server_passes_its_turn_to_the_next():
    upstream, clock = ScriptedUpstream(), Clock()
    upstream.script(R1, Reply(fails=CONNECT_TIMEOUT))
    upstream.script(R2, json_reply(RENDERED), json_reply(RENDERED))
    render, metrics = renderer(upstream, (R1, R2), clock)
    body = chat(image("a"))
    job = ClientBody(body, normalise_request(body).items)
    assert await render.render(job, CHAT) is None
    assert await render.render(job, CHAT) is not None and await render.render(job, CHAT) is not None
    assert [sent.url for sent in upstream.sent] == [R1, R2, R2] and counted(metrics, "skipped") == 0


async def test_under_no_rewrite_the_media_are_rendered_as_the_consumer_gets_them_named_by_vllm():
    upstream = ScriptedUpstream()
    upstream.script(R1, json_reply(RENDERED))
    config = Config(encode_urls=("http://e",), decode_urls=("http://pd",))
    render = Renderer(upstream, (R1,), Metrics(Registry.from_config(config), Health()), rewrite=False)
    body = chat(image("a"))
    await render.render(ClientBody(body, normalise_request(body).items), CHAT)
    (part,) = [p for p in upstream.sent[0].body["messages"][0]["content"] if p["type"] == "image_url"]
    assert "uuid" not in part


async def test_whether_the_model_is_a_lora_adapter_is_the_servers_model_list_to_say():
    upstream, clock = ScriptedUpstream(), Clock()
    listed = {"object": "list", "data": [{"id": "base", "parent": None}, {"id": "ada", "parent": "base"}]}
    upstream.script(
        R1,
        json_reply({**RENDERED, "model": "ada"}),
        json_reply(listed),
        json_reply({**RENDERED, "model": "base"}),
        json_reply({**RENDERED, "model": "other"}),
        json_reply({**RENDERED, "model": "other"}),
        Reply(fails=CONNECT_TIMEOUT),
    )
    render, metrics = renderer(upstream, (R1,), clock)
    body = chat(image("a"))
    job = ClientBody(body, normalise_request(body).items)
    lora = [(await render.render(job, CHAT)).lora_name for _ in range(3)]
    # A model not on the list is taken for a base model; the list is asked again only after REST_S.
    clock.now += REST_S
    lora.append((await render.render(job, CHAT)).lora_name)
    assert lora == ["ada", None, None, None]
    paths = [sent.path for sent in upstream.sent]
    assert paths == ["/v1/chat/completions/render", "/v1/models", *["/v1/chat/completions/render"] * 3, "/v1/models"]
    assert counted(metrics, "rendered") == 4 and counted(metrics, "failed") == 0
