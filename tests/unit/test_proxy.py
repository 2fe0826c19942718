"""The composition root (proxy.py): every part built from one Config and wired together."""

from __future__ import annotations

import time

from epd_proxy.config import Config
from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL
from epd_proxy.fleet.routing import RoundRobin
from epd_proxy.fleet.scheduler import ExpectedFinish, Lanes
from epd_proxy.journey.extract import ReadOptions
from epd_proxy.proxy import ProxyState, encode_policy

STATIC = {"encode_urls": ("http://e0", "http://e1"), "decode_urls": ("http://pd",)}


def test_expected_finish_places_on_the_shared_lanes_with_the_configs_switches():
    lanes = Lanes()
    policy = encode_policy(Config(encoder_affinity=False, adaptive_fan_out=True, **STATIC), lanes)
    assert isinstance(policy, ExpectedFinish) and not policy.affinity and policy.adaptive


def test_other_encode_policies_come_from_the_routing_factory():
    policy = encode_policy(Config(encode_policy="round_robin", **STATIC), Lanes())
    assert type(policy) is RoundRobin


def test_the_state_holds_one_policy_per_stage_and_the_listed_fleet():
    state = ProxyState(Config(prefill_policy="random", **STATIC))
    assert set(state.policies) == {ENCODE, PREFILL, DECODE}
    assert type(state.policies[PREFILL]).__name__ != type(state.policies[DECODE]).__name__
    assert sorted(inst.url for inst in state.fleet.all()) == ["http://e0", "http://e1", "http://pd"]
    assert state.roster is None and state.discovery is None and state.admission.inflight == 0
    assert state.parse_options == ReadOptions(trust_client_fields=False, max_media_items=256, media_hash="sha256")


async def test_start_builds_the_pipeline_and_a_prober_that_close_stops():
    state = ProxyState(Config(probe_interval_s=30, probe_timeout_s=1, **STATIC))
    await state.start()
    try:
        assert state.pipeline is not None and state.prober is not None and state.probes is not state.upstream
        assert state.pipeline.encode is not None
        tasks = list(state._background)
        assert tasks and not any(task.done() for task in tasks)
    finally:
        await state.close()
    assert all(task.done() for task in tasks)


async def test_without_probes_there_is_no_prober_and_no_check_pool():
    state = ProxyState(Config(probe_interval_s=0, **STATIC))
    await state.start()
    try:
        assert state.prober is None and state.probes is None and state._background == []
    finally:
        await state.close()


def test_dynamic_mode_forgets_instances_out_of_rotation_too_long():
    state = ProxyState(Config(dynamic_registration=True, admin_api_key="a", fail_threshold=1, evicted_ttl_s=5))
    assert state.fleet.register({"role": "encode", "url": "http://e9"})
    (inst,) = state.fleet.all()
    state.health.checked(inst, "refused")
    state.forget_expired()
    assert list(state.fleet.all()) == [inst], "out of rotation, but not yet for longer than the TTL"
    later = time.monotonic() + 6
    state.health._clock = lambda: later  # health judges against an injectable clock
    state.forget_expired()
    assert list(state.fleet.all()) == []


async def test_what_a_request_asks_of_the_encoders_counts_measured_encoders_and_each_workers_part_of_them():
    for workers in (1, 2):
        state = ProxyState(Config(probe_interval_s=0, workers=workers, **STATIC))
        await state.start()
        try:
            assert state.asked_of_encoders(3.0) == (0.0, 0.0)  # no encoder measured: no guess
            encoder = state.fleet.members(ENCODE)[0]
            speed = state.lanes.of(encoder).speed
            speed.observe(2.0, 10.0, 11.0)  # one answer: two image-equivalents in a second
            fixed, item = speed.known()
            asked, encoders = state.asked_of_encoders(3.0)
            assert asked == fixed + 3.0 * item
            # The other encoder is not counted until measured; a worker counts on its part.
            assert encoders == 1 / workers
        finally:
            await state.close()
