"""Isolation on request (docs/keys.md, `isolated = true`): an isolated tenant's prompts reach every
language-model engine under its own `cache_salt`, and its media under names of its own, so no
cache (encoder, EC store, processor, prefix) matches another tenant's entry for the same bytes;
everyone else's requests and names stay as they were."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from epd_proxy.tenants import parse_tenants
from tests.http.test_agent_doors import BODIES
from tests.http.test_tenants import bearer, digest, tenants_file
from tests.media import chat, image

TENANTS = f"""
[tenants.solo]
isolated = true
salt = "{"5" * 64}"
key_sha256 = ["{digest("solo-key")}"]

[tenants.other]
isolated = true
salt = "{"7" * 64}"
key_sha256 = ["{digest("other-key")}"]

[tenants.open]
key_sha256 = ["{digest("open-key")}"]
"""
SALTS = {name: tenant.cache_salt for name, tenant in parse_tenants(TENANTS).named.items()}
PICTURE = image("popular")
REFERENCE_NAME = hashlib.sha256(PICTURE["image_url"]["url"].encode()).hexdigest()


def uuids(body: dict[str, Any]) -> list[str]:
    return [
        part["uuid"]
        for message in body["messages"]
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and "uuid" in part
    ]


async def send(stack, key: str | None, **fields: Any) -> None:
    headers = bearer(key) if key else {}
    async with await stack.chat(chat(PICTURE, **fields), headers=headers) as resp:
        assert resp.status == 200, await resp.text()


async def test_an_isolated_tenants_engines_get_its_salt_and_its_media_a_name_of_its_own(make_stack, tmp_path):
    stack = await make_stack(encoders=1, tenants_file=tenants_file(tmp_path, TENANTS))
    seen: dict[str, tuple[Any, list[str], list[str]]] = {}
    for who, key in (("default", None), ("open", "open-key"), ("solo", "solo-key"), ("other", "other-key")):
        encoder, pd = len(stack.encoders[0].requests), len(stack.pd.requests)
        await send(stack, key, cache_salt="picked-by-the-client")
        [to_pd] = [s.body for s in stack.pd.requests[pd:]]
        to_encoder = [u for s in stack.encoders[0].requests[encoder:] for u in uuids(s.body)]
        seen[who] = (to_pd.get("cache_salt"), to_encoder, uuids(to_pd))
    # Tenants that are not isolated keep the reference proxy's names and their own salt.
    assert seen["default"] == ("picked-by-the-client", [REFERENCE_NAME], [REFERENCE_NAME])
    assert seen["open"][0] == "picked-by-the-client" and seen["open"][2] == [REFERENCE_NAME]
    # An isolated tenant's salt replaces the client's, and its image is named apart, the same
    # at the encoder as at the consumer.
    for who in ("solo", "other"):
        salt, to_encoder, to_pd = seen[who]
        assert salt == SALTS[who]
        assert to_encoder == to_pd and len(to_pd) == 1 and to_pd[0] != REFERENCE_NAME
    assert seen["solo"][2] != seen["other"][2]


async def test_prefill_and_decode_both_get_the_isolated_tenants_salt(make_stack, tmp_path):
    stack = await make_stack(encoders=1, prefills=1, tenants_file=tenants_file(tmp_path, TENANTS))
    await send(stack, "solo-key")
    [prefill] = stack.prefills[0].requests
    [decode] = stack.pd.requests
    assert prefill.body["cache_salt"] == decode.body["cache_salt"] == SALTS["solo"]


@pytest.mark.parametrize("door", ["responses", "messages"])
async def test_the_agent_doors_carry_the_isolated_tenants_salt_over_the_clients(make_stack, tmp_path, door):
    stack = await make_stack(encoders=1, tenants_file=tenants_file(tmp_path, TENANTS))
    body = BODIES[door]("popular", cache_salt="picked-by-the-client")
    headers = {"Authorization": "Bearer solo-key", "anthropic-version": "2023-06-01"}
    async with stack.client.post(f"{stack.url}/v1/{door}", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    [to_pd] = stack.pd.requests
    assert to_pd.body["cache_salt"] == SALTS["solo"]
    if door == "responses":  # the Messages door's consumer names its images itself (docs/keys.md)
        assert uuids(to_pd.body) and REFERENCE_NAME not in uuids(to_pd.body)


@pytest.mark.parametrize("isolated", [False, True])
async def test_what_isolation_costs_two_tenants_sending_one_popular_image(make_stack, tmp_path, isolated):
    """Two tenants, three requests each, alternating, the same image and text: shared, the second
    tenant finds what the first left; isolated, each pays for its own."""
    text = TENANTS if isolated else TENANTS.replace("isolated = true", "isolated = false").replace("salt = ", "# ")
    stack = await make_stack(encoders=1, tenants_file=tenants_file(tmp_path, text))
    for _ in range(3):
        for key in ("solo-key", "other-key"):
            await send(stack, key)
    counts = stack.pd.counts
    encoded = sum(stack.encoders[0].counts.images.values())
    prefix_hits = sum(counts.prefix_items.values())
    cached = sum(counts.cached_tokens.values()) / sum(counts.prompt_tokens.values())
    print(f"isolated={isolated}: encoder images {encoded}, consumer prefix hits {prefix_hits}/6, cached {cached:.0%}")
    # Each tenant encodes the image once and then finds its own prefix; shared, only the first does.
    assert (encoded, prefix_hits) == ((2, 4) if isolated else (1, 5))
