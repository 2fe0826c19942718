"""Tenants over HTTP: keys, the priority clamp, the trusted gateway header, SIGHUP, and the fast
answer to a request that cannot start in time (docs/keys.md, docs/failures.md)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import subprocess
import sys

import aiohttp
import anthropic
import openai
import orjson
import pytest

from epd_proxy.addresses import Networks
from epd_proxy.fleet.backends import ENCODE
from epd_proxy.tenants import PriorityRange
from epd_proxy_tools.testing.harness import serve_process
from epd_proxy_tools.testing.polling import eventually
from tests.http.test_agent_doors import messages_body
from tests.media import chat, image


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS = f"""
[default]
priority = [0, 0]

[tenants.acme]
priority = [-5, 5]
key_sha256 = ["{digest("acme-key")}"]

[tenants.batch]
priority = [10, 20]
deadline_ms = 1000
key_sha256 = ["{digest("batch-key")}"]
"""


def tenants_file(tmp_path, text: str = TENANTS) -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return str(path)


def openai_client(stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def backlog_on_every_encoder(stack, seconds: float) -> None:
    """Work of about `seconds` queued on each encoder, at a measured speed, as the lanes would
    count it with sub-requests in flight."""
    clock = stack.state.pipeline.encode.clock
    for encoder in stack.state.fleet.members(ENCODE):
        lane = stack.state.lanes.of(encoder)
        now = clock()
        lane.speed.observe(1.0, now - 1.0, now)  # one image-equivalent took about a second
        lane.started(seconds, now)


async def test_a_tenants_key_is_served_and_another_key_refused_in_each_doors_shape(make_stack, tmp_path):
    stack = await make_stack(encoders=1, tenants_file=tenants_file(tmp_path))
    messages = chat(image("A"))["messages"]
    async with openai_client(stack, "acme-key") as client:
        completion = await client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=4)
        assert completion.choices[0].message.content
    async with openai_client(stack, "stolen-key") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=4)
        with pytest.raises(openai.AuthenticationError):
            await client.responses.create(model="tiny-vlm", input="hi")
    body = messages_body("A")
    del body["stream"]
    async with anthropic.AsyncAnthropic(base_url=stack.url, api_key="acme-key", max_retries=0) as client:
        answer = await client.messages.create(**body)
        assert answer.content
    async with anthropic.AsyncAnthropic(base_url=stack.url, api_key="stolen-key", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as refusal:
            await client.messages.create(**body)
    assert refusal.value.body == {
        "type": "error",
        "error": {
            "type": "authentication_error",
            "message": "a valid 'Authorization: Bearer <key>' header is required",
        },
    }
    # A request without a key is the default tenant's.
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 200
    metrics = await stack.metrics()
    assert 'epd_tenant_requests_total{status="200",tenant="acme"} 2.0' in metrics
    assert 'epd_tenant_requests_total{status="200",tenant="default"} 1.0' in metrics
    assert "stolen" not in metrics


async def test_priority_is_clamped_in_what_the_encoder_and_the_consumer_receive(make_stack, tmp_path):
    stack = await make_stack(encoders=1, tenants_file=tenants_file(tmp_path))
    sent = [
        (bearer("acme-key"), {"priority": -1000000}, -5),
        (bearer("acme-key"), {"priority": 3}, 3),
        (bearer("batch-key"), {}, 10),
        ({}, {"priority": -1000000}, 0),
    ]
    for n, (headers, fields, expected) in enumerate(sent):
        async with await stack.chat(chat(image(f"P{n}"), **fields), headers=headers) as resp:
            assert resp.status == 200, await resp.text()
        assert stack.encoders[0].requests[-1].body.get("priority", 0) == expected, (fields, expected)
        assert stack.pd.requests[-1].body.get("priority", 0) == expected, (fields, expected)
    # vLLM would read a numeric string as an int: refused, not passed on unclamped.
    async with await stack.chat(chat(image("S"), priority="-1000000"), headers=bearer("acme-key")) as resp:
        assert resp.status == 400 and "priority must be an integer" in (await resp.json())["error"]["message"]


async def test_a_stream_whose_client_did_not_ask_for_usage_is_charged_and_relayed_as_the_consumer_would_answer(
    make_stack, tmp_path
):
    stack = await make_stack(encoders=1, tenants_file=tenants_file(tmp_path))
    body = chat(image("U"), stream=True)
    async with stack.client.post(stack.pd_url + "/v1/chat/completions", json=body) as direct:
        alone = await direct.read()
    client = openai_client(stack, "acme-key")
    stream = await client.chat.completions.create(**body)
    chunks = [chunk async for chunk in stream]
    # What the client gets is what it asked for: no usage chunk, and the fingerprint on the last one.
    assert [chunk.usage for chunk in chunks] == [None] * len(chunks)
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].system_fingerprint
    assert b'"usage"' not in alone and b'"system_fingerprint"' in alone
    async with stack.client.post(stack.url + "/v1/chat/completions", json=body, headers=bearer("acme-key")) as resp:
        relayed = await resp.read()
    assert re.sub(rb"chatcmpl-\d+", b"id", relayed) == re.sub(rb"chatcmpl-\d+", b"id", alone)
    assert stack.pd.requests[-1].body["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    status = await (await stack.client.get(stack.url + "/status.json")).json()
    assert status["tenants"]["acme"]["output_tokens"] > 0 and status["tenants"]["acme"]["prompt_tokens"] > 0
    # And placement learnt the prompt's size from both answers.
    assert status["prompt_size"]["answers_heard"] == 2
    # A spelling vLLM would read as false, which would hide the tokens: refused, as `stream` is.
    loose = chat(image("V"), stream=True, stream_options={"include_usage": "no"})
    async with stack.client.post(stack.url + "/v1/chat/completions", json=loose, headers=bearer("acme-key")) as resp:
        assert resp.status == 400 and "include_usage" in (await resp.json())["error"]["message"]


async def test_without_tenants_the_global_priority_range_clamps_every_request(make_stack):
    stack = await make_stack(encoders=1, priority_range=PriorityRange(-1, 1))
    async with await stack.chat(chat(image("A"), priority=-1000000)) as resp:
        assert resp.status == 200
    assert stack.encoders[0].requests[-1].body["priority"] == -1 and stack.pd.requests[-1].body["priority"] == -1


@pytest.mark.parametrize("trusted, tenant", [("127.0.0.1", "batch"), ("10.0.0.0/8", "default")])
async def test_the_tenant_header_is_honoured_only_from_a_trusted_proxy(make_stack, tmp_path, trusted, tenant):
    stack = await make_stack(
        encoders=1,
        tenants_file=tenants_file(tmp_path),
        tenant_header="x-tenant",
        trusted_proxies=Networks().parse(trusted),
    )
    async with await stack.chat(chat(image("A")), headers={"x-tenant": "batch"}) as resp:
        assert resp.status == 200
    assert stack.pd.requests[-1].body.get("priority", 0) == (10 if tenant == "batch" else 0)
    assert f'epd_tenant_requests_total{{status="200",tenant="{tenant}"}} 1.0' in await stack.metrics()
    async with await stack.chat(chat(image("A")), headers={"x-tenant": "nobody"}) as resp:
        assert resp.status == (401 if tenant == "batch" else 200)


async def test_a_request_that_cannot_start_within_its_deadline_is_answered_at_once(make_stack, tmp_path):
    stack = await make_stack(encoders=2, tenants_file=tenants_file(tmp_path), consumer_encode=False)
    backlog_on_every_encoder(stack, 40.0)
    headers = {**bearer("acme-key"), "x-request-deadline-ms": "2000"}
    async with await stack.chat(chat(image("A")), headers=headers) as resp:
        assert resp.status == 503, await resp.text()
        assert 20 <= int(resp.headers["Retry-After"]) <= 40
        error = (await resp.json())["error"]
    assert error["type"] == "overloaded" and "beyond its deadline of 2.0 s" in error["message"]
    # The tenant's own deadline applies without a header; the Messages door answers in its shape.
    status, _, raw = await _post_messages(stack, bearer("batch-key"))
    assert status == 503 and orjson.loads(raw)["type"] == "error"
    assert orjson.loads(raw)["error"]["type"] == "overloaded"
    # A request without media waits for no encoder; one without a deadline waits as long as it takes.
    async with await stack.chat(chat(), headers=headers) as resp:
        assert resp.status == 200
    assert stack.encoder_requests() == []
    metrics = await stack.metrics()
    assert 'epd_requests_shed_total{reason="deadline",tenant="acme"} 1.0' in metrics
    assert 'epd_requests_shed_total{reason="deadline",tenant="batch"} 1.0' in metrics
    assert 'epd_tenant_requests_total{status="503",tenant="acme"} 1.0' in metrics


async def test_a_bad_deadline_header_is_a_400(make_stack):
    stack = await make_stack(encoders=1)
    async with await stack.chat(chat(image("A")), headers={"x-request-deadline-ms": "soon"}) as resp:
        assert resp.status == 400 and "x-request-deadline-ms" in (await resp.json())["error"]["message"]


async def test_the_max_inflight_503_says_when_to_retry_from_the_backlog(make_stack):
    stack = await make_stack(encoders=1, max_inflight=1, consumer_encode=False)
    stack.pd.faults.delay_s = 2
    slow = asyncio.create_task(stack.chat(chat()))
    await eventually(lambda: stack.state.admission.inflight == 1, timeout=20, what="the slow request holds the slot")
    backlog_on_every_encoder(stack, 20.0)
    async with await stack.chat(chat(image("A"))) as resp:
        assert resp.status == 503 and 15 <= int(resp.headers["Retry-After"]) <= 21
    async with await slow as resp:
        assert resp.status == 200
    metrics = await stack.metrics()
    assert 'epd_requests_shed_total{reason="inflight",tenant="default"} 1.0' in metrics
    # How long the proxy took to answer it, by its own clock.
    assert 'epd_shed_answer_seconds_count{reason="inflight"} 1.0' in metrics


async def _post_messages(stack, headers):
    async with stack.client.post(f"{stack.url}/v1/messages", json=messages_body("A"), headers=headers) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


async def test_sighup_reloads_the_tenants_file_and_a_bad_one_keeps_the_tenants_in_force(tmp_path):
    path = tenants_file(tmp_path)
    async with serve_process("--tenants", path) as served, aiohttp.ClientSession() as session:

        async def status(key: str) -> int:
            async with session.post(f"{served.url}/v1/chat/completions", json=chat(), headers=bearer(key)) as resp:
                return resp.status

        async def reloads(outcome: str) -> float:
            async with session.get(f"{served.url}/metrics") as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith(f'epd_tenants_reloads_total{{outcome="{outcome}"}}'):
                        return float(line.split()[-1])
            return 0.0

        assert await status("acme-key") == 200 and await status("zeta-key") == 401
        (tmp_path / "tenants.toml").write_text(f"[tenants.zeta]\nkey_sha256 = ['{digest('zeta-key')}']\n")
        os.kill(served.proc.pid, signal.SIGHUP)
        await eventually(lambda: _is(status("zeta-key"), 200), what="the new tenant's key is taken")
        assert await status("acme-key") == 401
        (tmp_path / "tenants.toml").write_text("[tenants.zeta]\nweight = -1\n")
        os.kill(served.proc.pid, signal.SIGHUP)
        await eventually(lambda: _is(reloads("refused"), 1.0), what="the bad file is refused")
        assert await status("zeta-key") == 200 and served.proc.poll() is None
        assert await reloads("ok") == 1.0


async def test_with_workers_sighup_reaches_every_worker(tmp_path):
    path = tenants_file(tmp_path)
    async with serve_process("--tenants", path, "--workers", "2") as served:

        async def every_connection_takes(key: str) -> bool:
            # A fresh connection per request: the kernel spreads them over both workers.
            for _ in range(8):
                async with aiohttp.ClientSession() as session:
                    url = f"{served.url}/v1/chat/completions"
                    async with session.post(url, json=chat(), headers=bearer(key)) as resp:
                        if resp.status != 200:
                            return False
            return True

        await eventually(lambda: every_connection_takes("acme-key"), timeout=30, what="both workers serve acme")
        (tmp_path / "tenants.toml").write_text(f"[tenants.zeta]\nkey_sha256 = ['{digest('zeta-key')}']\n")
        os.kill(served.proc.pid, signal.SIGHUP)
        await eventually(lambda: every_connection_takes("zeta-key"), timeout=30, what="every worker took the new file")
        assert served.proc.poll() is None


def _holds_hangups(pid: int) -> bool:
    """Whether the process `pid` has SIGHUP blocked (pending, not lost) right now."""
    try:
        with open(f"/proc/{pid}/status") as status:
            blocked = next(line for line in status if line.startswith("SigBlk:"))
    except (OSError, StopIteration):
        return False
    return bool(int(blocked.split()[1], 16) & (1 << (signal.SIGHUP - 1)))


async def _hang_up_while_starting(proc: subprocess.Popen, pid_of=lambda proc: proc.pid) -> None:
    """SIGHUP to `proc` at a moment its server (found by `pid_of`) is still starting."""
    await eventually(
        lambda: _holds_hangups(pid_of(proc) or 0), timeout=30, interval=0.001, what="the starting server holds SIGHUP"
    )
    os.kill(proc.pid, signal.SIGHUP)


async def _reloads(url: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith('epd_tenants_reloads_total{outcome="ok"}'):
                return float(line.split()[-1])
    return 0.0


async def test_a_sighup_while_the_proxy_starts_is_a_reload_once_it_serves(tmp_path):
    async with serve_process("--tenants", tenants_file(tmp_path), starting=_hang_up_while_starting) as served:
        await eventually(lambda: _is(_reloads(served.url), 1.0), what="the early SIGHUP read the file again")
        assert served.proc.poll() is None


def _a_worker(proc: subprocess.Popen) -> int | None:
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as children:
            pids = children.read().split()
    except OSError:
        return None
    return int(pids[0]) if pids else None


async def test_with_workers_a_sighup_while_they_start_reaches_each_once_it_serves(tmp_path):
    async def hang_up(proc: subprocess.Popen) -> None:
        await _hang_up_while_starting(proc, _a_worker)

    async with serve_process("--tenants", tenants_file(tmp_path), "--workers", "2", starting=hang_up) as served:
        await eventually(lambda: _is(_reloads(served.url), 2.0), timeout=30, what="both workers read the file again")
        assert served.proc.poll() is None


async def _is(value, expected) -> bool:
    return await value == expected


def test_a_bad_tenants_file_at_start_is_a_usage_error(tmp_path):
    path = tenants_file(tmp_path, "[tenants.acme]\nweight = 0\n")
    urls = ("--encode-servers-urls", "http://e:1", "--decode-servers-urls", "http://d:1")
    done = subprocess.run(
        [sys.executable, "-m", "epd_proxy", "serve", *urls, "--tenants", path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "tenants file: tenant 'acme': weight must be a number > 0" in done.stderr


async def test_an_isolated_tenants_media_never_share_an_encoder_sub_request(make_stack, tmp_path):
    text = TENANTS + f"\n[tenants.solo]\nisolated = true\nsalt = '{'5' * 64}'\nkey_sha256 = ['{digest('solo-key')}']\n"
    stack = await make_stack(encoders=1, tenants_file=tenants_file(tmp_path, text))
    fake = stack.encoders[0]
    fake.faults.delay_s = 0.6
    async with await stack.chat(chat(image("warm-up"))) as resp:
        assert resp.status == 200
    blockers = [asyncio.create_task(stack.chat(chat(image(f"blocker{i}")))) for i in range(2)]
    await eventually(lambda: len(fake.requests) == 3, what="both of the encoder's slots busy")
    # Queued behind the busy encoder, the default tenant's two requests share one sub-request and
    # the isolated tenant's two go alone.
    sent = [(f"d{i}", {}) for i in range(2)] + [(f"s{i}", bearer("solo-key")) for i in range(2)]
    tasks = [asyncio.create_task(stack.chat(chat(image(name)), headers=headers)) for name, headers in sent]
    for task in [*blockers, *tasks]:
        async with await task as resp:
            assert resp.status == 200
    later = fake.requests[3:]  # after the warm-up and the blockers
    shared = [seen for seen in later if seen.headers["x-request-id"].startswith("shared-")]
    assert len(later) == 1 + 2 and len(shared) == 1
    assert len(shared[0].body["messages"][0]["content"]) == 2
