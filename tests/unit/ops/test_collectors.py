"""The scrape-time collectors (collectors.py) over stand-in parts: what each exports, read when
/metrics is asked, and that a part with nothing to say leaves a series out rather than inventing it."""

from __future__ import annotations

from types import SimpleNamespace

from epd_proxy.ops.collectors import DnsCollector, Fixed, RosterCollector


def samples(collector) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in collector.collect()
        for sample in family.samples
    }


def test_the_roster_store_is_up_or_down_with_the_time_since_its_last_read():
    roster = SimpleNamespace(up=False, seconds_since_sync=lambda: 7.5)
    assert samples(RosterCollector(roster)) == {
        ("epd_roster_up", ()): 0,
        ("epd_roster_seconds_since_sync", ()): 7.5,
    }


def test_a_roster_never_read_has_no_age():
    roster = SimpleNamespace(up=True, seconds_since_sync=lambda: None)
    assert samples(RosterCollector(roster)) == {("epd_roster_up", ()): 1}


def test_each_dns_name_reports_its_last_answer_and_a_name_never_resolved_has_no_age():
    discovery = SimpleNamespace(figures=lambda: [("dns://enc:8001", True, 3, 1.25), ("dns://pd:8002", False, 0, None)])
    got = samples(DnsCollector(discovery))
    assert got == {
        ("epd_dns_up", (("name", "dns://enc:8001"),)): 1,
        ("epd_dns_addresses", (("name", "dns://enc:8001"),)): 3,
        ("epd_dns_seconds_since_success", (("name", "dns://enc:8001"),)): 1.25,
        ("epd_dns_up", (("name", "dns://pd:8002"),)): 0,
        ("epd_dns_addresses", (("name", "dns://pd:8002"),)): 0,
    }


def test_fixed_families_are_handed_back_as_given():
    families = [object(), object()]
    assert list(Fixed(families).collect()) == families
