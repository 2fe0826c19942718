"""The shared roster's pure parts: URL handling, stored records, and how a roster read is applied
to a process's registry (membership changes, health state stays)."""

from __future__ import annotations

import pytest

from epd_proxy.config import Config, ConfigError
from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL, PREFILL_DECODE
from epd_proxy.fleet.health import DOWN, HEALTHY, Health
from epd_proxy.fleet.registry import Record, Registry, RegistryError, check_fits
from epd_proxy.fleet.roster import decode_record, encode_record, redacted, split_roster_url


def test_prefix_is_ours_and_the_rest_of_the_url_goes_to_the_client():
    assert split_roster_url("redis://h:6379/2?prefix=fleet-a&socket_keepalive=true") == (
        "redis://h:6379/2?socket_keepalive=true",
        "fleet-a",
    )
    assert split_roster_url("redis://h:6379/0") == ("redis://h:6379/0", "epd")
    with pytest.raises(ValueError, match="redis://"):
        split_roster_url("etcd://h:2379/epd")


def test_store_password_never_shows():
    assert redacted("redis://:s3cret@h:6379/0") == "redis://***@h:6379/0"
    assert redacted("rediss://user:s3cret@h:6379/0?prefix=x") == "rediss://user:***@h:6379/0?prefix=x"
    assert redacted("redis://h:6379/0") == "redis://h:6379/0"


def test_records_round_trip_and_garbage_is_skipped():
    record = Record("http://p:1", PREFILL_DECODE, ("tcp://a:1", "tcp://a:2"), 2, seq=7, gen=9)
    assert decode_record(encode_record(record)) == record
    assert decode_record(b"not json") is None
    assert decode_record(b'{"url": "http://x"}') is None


@pytest.mark.parametrize(
    "kwargs, complaint",
    [
        ({"roster_url": "redis://h:6379/0"}, "--dynamic-registration"),
        ({"roster_url": "etcd://h:2379", "dynamic_registration": True, "admin_api_key": "k"}, "redis://"),
    ],
)
def test_roster_flag_checks(kwargs, complaint):
    base = {"encode_urls": ("http://e",), "decode_urls": ("http://d",)}
    if kwargs.get("dynamic_registration"):
        base = {}
    with pytest.raises(ConfigError, match=complaint):
        Config(**{**base, **kwargs})


def test_workers_in_dynamic_mode_need_the_roster(monkeypatch, capsys):
    from epd_proxy import cli

    monkeypatch.setenv("ADMIN_API_KEY", "k")
    with pytest.raises(SystemExit):
        cli.main(["serve", "--dynamic-registration", "--workers", "2"])
    assert "--roster" in capsys.readouterr().err
    started = []
    monkeypatch.setattr(cli, "serve", lambda config: started.append((config.roster_url, config.workers)))
    assert cli.main(["serve", "--dynamic-registration", "--workers", "2", "--roster", "redis://h:6379/0"]) == 0
    assert started == [("redis://h:6379/0", 2)]


def fleet() -> tuple[Registry, Health]:
    registry, health = Registry(dynamic=True), Health(fail_threshold=1)
    registry.watch(health)
    return registry, health


def urls(instances) -> list[str]:
    return [inst.url for inst in instances]


def test_sync_adds_and_removes_members_and_local_health_state_stays():
    registry, health = fleet()
    e1, e2, pd = (
        Record("http://e1", ENCODE, seq=2),
        Record("http://e2", ENCODE, seq=1),
        Record("http://pd", PREFILL_DECODE),
    )
    registry.sync({r.url: r for r in (e1, e2, pd)})
    # Registration order from the store, whatever order the read returned.
    assert urls(registry.members(ENCODE)) == ["http://e2", "http://e1"]
    first = registry.members(ENCODE)[1]
    health.checked(first, "HTTP 503")
    assert health.state("http://e1") == DOWN

    # The same records again: the members are the same objects and this process's verdict stays.
    registry.sync({r.url: r for r in (e1, e2, pd)})
    assert registry.members(ENCODE)[1] is first and health.state("http://e1") == DOWN
    assert registry.snapshot(health.in_rotation)[ENCODE] == {"live": ["http://e2"], "evicted": ["http://e1"]}

    # e1 left the store: it leaves the fleet, and health forgets it (a late report changes nothing).
    registry.sync({r.url: r for r in (e2, pd)})
    assert urls(registry.members(ENCODE)) == ["http://e2"]
    health.checked(first, "late")
    assert sorted(urls(registry.all())) == ["http://e2", "http://pd"] and health.out_longer_than(0) == []


def test_a_registration_through_any_process_resets_local_health_as_a_local_one_does():
    registry, health = fleet()
    registry.sync({"http://e": Record("http://e", ENCODE, seq=1, gen=1)})
    (inst,) = registry.members(ENCODE)
    health.checked(inst, "refused")
    registry.sync({"http://e": Record("http://e", ENCODE, seq=1, gen=1)})
    assert health.state("http://e") == DOWN  # a periodic read is no news
    registry.sync({"http://e": Record("http://e", ENCODE, seq=1, gen=5)})
    assert health.state("http://e") == HEALTHY and registry.members(ENCODE) == [inst]


def test_sync_updates_details_in_place_and_replaces_a_changed_role():
    registry, _ = fleet()
    registry.sync({"http://x": Record("http://x", PREFILL_DECODE)})
    inst = registry.members(PREFILL_DECODE)[0]
    inst.inflight = 3
    registry.sync({"http://x": Record("http://x", PREFILL_DECODE, ("tcp://a:1", "tcp://a:2"), 2)})
    assert registry.members(PREFILL_DECODE)[0] is inst and inst.dp_size == 2 and inst.inflight == 3
    registry.sync({"http://x": Record("http://x", ENCODE)})
    assert registry.members(PREFILL_DECODE) == [] and urls(registry.members(ENCODE)) == ["http://x"]


def test_conflicts_are_judged_against_any_membership_view():
    members = {"http://pd": Record("http://pd", PREFILL_DECODE), "http://e": Record("http://e", ENCODE)}
    for clash in (Record("http://p", PREFILL), Record("http://d", DECODE), Record("http://e", PREFILL_DECODE)):
        with pytest.raises(RegistryError) as err:
            check_fits(clash, members)
        assert err.value.status == 409
    check_fits(Record("http://e2", ENCODE), members)
    check_fits(Record("http://pd", PREFILL_DECODE, ("tcp://a:1",)), members)


async def test_closing_never_hangs_on_a_swallowed_cancellation():
    """redis-py can swallow a task cancellation at a read timeout's edge (its issue #2551): the
    follower must still stop when the roster is closed."""
    import asyncio

    from epd_proxy.fleet.roster import RedisRoster

    roster = RedisRoster("redis://127.0.0.1:1/0", ttl_s=60, on_change=lambda records: None, in_rotation=list)
    swallowed = 0

    async def follow_like_a_swallowing_client() -> None:
        nonlocal swallowed
        while not roster._closed:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                swallowed += 1  # what a read that eats the cancellation looks like from outside

    roster._follow = follow_like_a_swallowing_client
    await roster.start(first_sync_timeout_s=0.05)
    async with asyncio.timeout(10):
        await roster.close()
    assert swallowed >= 1 and roster._task.done()
