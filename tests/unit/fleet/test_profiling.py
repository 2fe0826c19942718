"""The profiling fan-out over a scripted backend-call layer: every instance in rotation, one answer per stage."""

from __future__ import annotations

import pytest

from epd_proxy.calls.upstream import REFUSED
from epd_proxy.config import Config
from epd_proxy.errors import ProxyError
from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL, PREFILL_DECODE
from epd_proxy.fleet.health import Health
from epd_proxy.fleet.profiling import Profiling
from epd_proxy.fleet.registry import Registry
from tests.unit.scripted_upstream import Reply, ScriptedUpstream

CONFIG = Config(encode_urls=("http://e1", "http://e2"), decode_urls=("http://pd",))


def profiling(config: Config = CONFIG, *, by_role: bool = False, api_key: str = "prof"):
    fleet = Registry.from_config(config)
    health = Health(fail_threshold=1)
    fleet.watch(health)
    calls = ScriptedUpstream()
    return Profiling(fleet, health, calls, api_key=api_key, by_role=by_role), calls, fleet, health


async def test_every_instance_in_rotation_is_asked_with_the_profiling_key():
    fan_out, calls, fleet, health = profiling()
    calls.script("http://e1", Reply(200, (b"started",)))
    calls.script("http://pd", Reply(500, (b"\xffboom",)))
    [e2] = [inst for inst in fleet.all() if inst.url == "http://e2"]
    health.checked(e2, "refused")  # out of rotation: not asked
    out = await fan_out.fan_out("start_profile", b'{"x": 1}')
    # The reference's shape: a combined instance answers under decode, a stage without any under None.
    assert out == {
        ENCODE: {"http://e1": {"status": 200, "body": "started"}},
        PREFILL: None,
        DECODE: {"http://pd": {"status": 500, "body": "\ufffdboom"}},
    }
    assert {sent.url for sent in calls.sent} == {"http://e1", "http://pd"}
    for sent in calls.sent:
        assert (sent.method, sent.path, sent.body, sent.stage) == ("POST", "/start_profile", {"x": 1}, "profile")
        assert sent.headers == {"Content-Type": "application/json", "Authorization": "Bearer prof"}
        assert sent.options["count_inflight"] is False


async def test_an_instance_without_profiling_is_none_and_one_that_never_answers_says_why():
    fan_out, calls, _, _ = profiling(api_key="")
    calls.script("http://e1", Reply(404))
    calls.script("http://e2", Reply(fails=REFUSED))
    calls.script("http://pd", Reply(404))
    out = await fan_out.fan_out("stop_profile", b"{}")
    assert out[DECODE] is None and out[PREFILL] is None
    assert out[ENCODE] == {"http://e2": {"status": None, "error": "stop_profile failed: scripted"}}
    assert all("Authorization" not in sent.headers for sent in calls.sent)


async def test_when_no_instance_has_profiling_on_it_is_a_503():
    fan_out, calls, _, _ = profiling()
    for url in ("http://e1", "http://e2", "http://pd"):
        calls.script(url, Reply(404))
    with pytest.raises(ProxyError, match="disabled on all clusters") as refusal:
        await fan_out.fan_out("start_profile", b"{}")
    assert refusal.value.status == 503


async def test_dynamic_mode_answers_by_role():
    config = Config(dynamic_registration=True, admin_api_key="adm")
    fan_out, calls, fleet, _ = profiling(config, by_role=True)
    fleet.register({"role": PREFILL_DECODE, "url": "http://pd"})
    calls.script("http://pd", Reply(200, (b"ok",)))
    assert await fan_out.fan_out("start_profile", b"{}") == {
        PREFILL_DECODE: {"http://pd": {"status": 200, "body": "ok"}}
    }
