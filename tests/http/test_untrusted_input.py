"""Untrusted clients: no part the proxy forwards names data it did not see; access is authenticated."""

from __future__ import annotations

import hashlib

import openai
import pytest

from epd_proxy_tools.testing.fake_vllm import vllm_part_kind
from tests.media import chat, image

EMBEDS = {"image_grid_thw": [1, 4, 4]}
URL_A = image("A")["image_url"]

# Each is read by vLLM's chat parser as an embeddings or cache reference, or names two kinds; all
# passed the type-keyed deny-list this pass replaced, and the first kills a real vLLM PD engine.
BYPASSES = [
    {"image_embeds": EMBEDS, "uuid": "0000deadbeef"},
    {"type": "", "image_embeds": EMBEDS},
    {"type": "text", "text": "x", "image_embeds": EMBEDS, "uuid": "u"},
    {"type": "text", "text": "x", "image_url": URL_A, "uuid": "another callers hash"},
    {"type": "image_url", "image_url": URL_A, "image_embeds": EMBEDS, "uuid": "u"},
    {"audio_embeds": {"audio_feature_lengths": [4]}},
    {"image_pil": None, "uuid": "cached"},
    {"type": "prompt_embeds", "data": "AAAA"},
]


@pytest.mark.parametrize("rewrite", [True, False], ids=["rewrite", "no-rewrite"])
@pytest.mark.parametrize("part", BYPASSES)
async def test_bypasses_are_refused_before_any_backend_sees_them(make_stack, part, rewrite):
    stack = await make_stack(encoders=2, rewrite=rewrite)
    async with await stack.chat(chat(image("B"), part)) as resp:
        body = await resp.json()
    assert resp.status == 400, body
    assert body["error"]["stage"] == "request" and "messages[0].content[2]" in body["error"]["message"]
    assert stack.encoder_requests() == [] and stack.pd.requests == []


@pytest.mark.parametrize("part", [*BYPASSES[:3], {"type": "image_url", "image_url": None, "uuid": "cached"}])
async def test_a_tool_messages_parts_are_guarded_like_a_users(make_stack, part):
    stack = await make_stack(encoders=1)
    body = chat(image("B"))
    call = {"id": "c1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
    body["messages"] += [
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "now:"}, part]},
    ]
    async with await stack.chat(body) as resp:
        answer = await resp.json()
    assert resp.status == 400 and "messages[2].content[1]" in answer["error"]["message"], answer
    assert stack.encoder_requests() == [] and stack.pd.requests == []


def forwarded_uuids(bodies) -> set[str]:
    return {
        part["uuid"]
        for body in bodies
        for message in body["messages"]
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and "uuid" in part
    }


@pytest.mark.parametrize("rewrite", [True, False], ids=["rewrite", "no-rewrite"])
async def test_client_uuids_never_reach_a_backend(make_stack, rewrite):
    stack = await make_stack(encoders=2, rewrite=rewrite)
    body = chat(
        {**image("A"), "uuid": "someone-elses-hash"},
        {"image_url": image("B")["image_url"], "uuid": "another"},
        {"type": "text", "text": "more", "uuid": "on-text"},
    )
    async with await stack.chat(body) as resp:
        assert resp.status == 200, await resp.text()
    ours = {hashlib.sha256(image(n)["image_url"]["url"].encode()).hexdigest() for n in "AB"}
    pd_bodies = [seen.body for seen in stack.pd.requests]
    if rewrite:
        assert forwarded_uuids(stack.encoder_requests()) == ours
        assert forwarded_uuids(pd_bodies) == ours
    else:  # the reference's raw mode: no uuid at all, both sides hash the content themselves
        assert forwarded_uuids(stack.encoder_requests()) == set()
        assert forwarded_uuids(pd_bodies) == set()
    for seen in [*stack.encoder_requests(), *pd_bodies]:
        kinds = [vllm_part_kind(p) for m in seen["messages"] for p in m["content"] if isinstance(m["content"], list)]
        assert not {"image_pil", "prompt_embeds"} & set(kinds)


async def test_trusted_router_keeps_its_uuids(make_stack):
    stack = await make_stack(encoders=1, trust_client_fields=True)
    async with await stack.chat(chat({**image("A"), "uuid": "router-chosen"})) as resp:
        assert resp.status == 200, await resp.text()
    assert forwarded_uuids(stack.encoder_requests()) == {"router-chosen"}


def sdk(stack, key: str):
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


async def test_api_key_guards_the_openai_routes(make_stack):
    stack = await make_stack(encoders=1, api_key="client-secret", backend_api_key="backend-secret")
    messages = chat(image("A"))["messages"]
    async with sdk(stack, "client-secret") as client:
        completion = await client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=4)
        assert completion.choices[0].message.content
        assert [m.id for m in (await client.models.list()).data] == ["tiny-vlm"]
    async with sdk(stack, "wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=4)
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    # No key at all: the SDK needs one to start, so it is told to omit the header.
    async with sdk(stack, "unused") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(
                model="tiny-vlm", messages=messages, max_tokens=4, extra_headers={"Authorization": openai.Omit()}
            )
    for headers in ({}, {"Authorization": "client-secret"}, {"Authorization": "Basic client-secret"}):
        async with await stack.chat(chat(image("A")), headers=headers) as resp:
            assert resp.status == 401 and (await resp.json())["error"]["type"] == "authentication_error"
    async with stack.client.get(f"{stack.url}/health") as resp:
        assert resp.status == 200
    async with stack.client.get(f"{stack.url}/metrics") as resp:
        assert resp.status == 200
    # Backends get the backend key, never the client's.
    seen = [s.headers.get("authorization") for f in (*stack.encoders, stack.pd) for s in f.requests]
    assert seen and set(seen) == {"Bearer backend-secret"}


async def test_without_a_backend_key_no_authorization_is_sent(make_stack, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-a-real-openai-key")
    stack = await make_stack(encoders=1)
    headers = {"Authorization": "Bearer sk-a-real-openai-key"}
    async with await stack.chat(chat(image("A")), headers=headers) as resp:
        assert resp.status == 200
    seen = [s.headers.get("authorization") for f in (*stack.encoders, stack.pd) for s in f.requests]
    assert seen and set(seen) == {None}


@pytest.mark.parametrize(
    "keys, presented, status",
    [
        ({}, None, 200),
        ({"admin_api_key": "adm"}, None, 403),
        ({"admin_api_key": "adm"}, "adm", 200),
        ({"api_key": "client"}, None, 403),
        ({"api_key": "client", "admin_api_key": "adm"}, "client", 403),
        ({"api_key": "client", "admin_api_key": "adm"}, "adm", 200),
    ],
)
async def test_profiling_is_an_admin_action(make_stack, keys, presented, status):
    stack = await make_stack(encoders=1, **keys)
    headers = {"X-API-Key": presented} if presented else {}
    async with stack.client.post(f"{stack.url}/start_profile", json={}, headers=headers) as resp:
        assert resp.status == status, await resp.text()


async def test_a_key_that_is_not_utf8_is_a_401_not_a_crash(make_stack):
    import asyncio

    stack = await make_stack(encoders=1, api_key="client-secret")
    host, port = stack.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert head.startswith(b"HTTP/1.1 401"), head[:200]


async def test_an_authenticated_proxy_shows_its_roster_to_admins_only(make_stack):
    stack = await make_stack(dynamic=True, admin_api_key="adm", api_key="client")
    url = stack.url + "/instances"
    async with stack.client.get(url, headers={"Authorization": "Bearer client"}) as resp:
        assert resp.status == 403
    async with stack.client.get(url, headers={"X-API-Key": "adm"}) as resp:
        assert resp.status == 200
