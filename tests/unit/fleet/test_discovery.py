"""DNS discovery without a DNS server: a scripted client, the registry's ownership rules, the
config's refusals. The real server (unbound) is tests/http/test_dns.py's."""

from __future__ import annotations

import pytest

from epd_proxy.config import Config, ConfigError
from epd_proxy.fleet.backends import Instance
from epd_proxy.fleet.discovery import Discovery, DnsClient, ResolutionFailed, backend_url, dns_names, resolve
from epd_proxy.fleet.health import Health
from epd_proxy.fleet.registry import REGISTERED, Registry, RegistryError
from epd_proxy_tools.testing.polling import eventually


class Scripted:
    """DNS as a dict: host -> addresses, SRV name -> [(target, port, addresses or None)];
    a name mapped to an exception raises it."""

    def __init__(self, answers: dict) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def _answer(self, name: str):
        self.asked.append(name)
        answer = self.answers.get(name, [])
        if isinstance(answer, Exception):
            raise answer
        return list(answer)

    async def addresses(self, host: str) -> list[str]:
        return self._answer(host)

    async def services(self, name: str):
        return self._answer(name)


def urls(instances) -> list[str]:
    return [inst.url for inst in instances]


def test_backend_urls_bracket_ipv6_and_normalise_it():
    assert backend_url("10.0.0.1", 8000) == "http://10.0.0.1:8000"
    assert backend_url("fd00:0::1", 8000) == "http://[fd00::1]:8000"


def test_names_take_their_flags_role():
    config = Config(
        encode_urls=("http://e0", "dns://enc:8001"),
        prefill_urls=("dns+srv://_http._tcp.p",),
        decode_urls=("dns://d:8002",),
    )
    assert [(n.entry, n.role, n.host, n.port) for n in dns_names(config)] == [
        ("dns://enc:8001", "encode", "enc", 8001),
        ("dns+srv://_http._tcp.p", "prefill", "_http._tcp.p", None),
        ("dns://d:8002", "decode", "d", 8002),
    ]
    assert dns_names(Config(encode_urls=("http://e",), decode_urls=("dns://pd:1",)))[0].role == "prefill_decode"
    # The listed URL is a member from the start; the names' members come from discovery.
    assert urls(Registry.from_config(config).all()) == ["http://e0"]


async def test_srv_targets_use_the_additional_section_when_it_has_them():
    client = Scripted({"_x._tcp.s": [("a.", 9001, ["10.0.0.1"]), ("b.", 9002, None)], "b.": ["10.0.0.2", "fd00::2"]})
    (name,) = dns_names(Config(encode_urls=("dns+srv://_x._tcp.s",), decode_urls=("http://d",)))
    assert await resolve(client, name) == ["http://10.0.0.1:9001", "http://10.0.0.2:9002", "http://[fd00::2]:9002"]
    assert client.asked == ["_x._tcp.s", "b."]


def discovery(answers: dict, fleet: Registry | None = None, *entries: str, **kwargs):
    config = Config(encode_urls=entries or ("dns://enc:8000",), decode_urls=("http://pd",))
    fleet = fleet or Registry.from_config(config)
    failures: list[str] = []
    found = Discovery(
        dns_names(config), fleet, Scripted(answers), refresh_s=kwargs.pop("refresh_s", 60), on_failure=failures.append
    )
    return found, fleet, failures


async def test_the_resolved_set_joins_leaves_and_survives_a_failure():
    found, fleet, failures = discovery({"enc": ["10.0.0.2", "10.0.0.1"]})
    health = Health()
    fleet.watch(health)
    await found.resolve_now("dns://enc:8000")
    assert urls(fleet.members("encode")) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    kept = fleet.members("encode")[0]
    kept.inflight = 3

    found._client.answers["enc"] = ["10.0.0.1", "10.0.0.3"]
    await found.resolve_now("dns://enc:8000")
    assert urls(fleet.members("encode")) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    assert fleet.members("encode")[0] is kept and kept.inflight == 3  # a member that stays is the same object

    found._client.answers["enc"] = ResolutionFailed("SRV enc: no answer within 3s")
    await found.resolve_now("dns://enc:8000")
    assert urls(fleet.members("encode")) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    view = found.status()["dns://enc:8000"]
    assert view["status"] == "failing" and "no answer" in view["error"] and failures == ["dns://enc:8000"]
    assert [(n, ok, count) for n, ok, count, _ in found.figures()] == [("dns://enc:8000", False, 2)]

    found._client.answers["enc"] = []  # an answer: no such records (a Service scaled to zero)
    await found.resolve_now("dns://enc:8000")
    assert fleet.members("encode") == [] and found.status()["dns://enc:8000"]["status"] == "ok"


async def test_an_address_another_source_holds_is_left_out_and_said_why():
    fleet = Registry(dynamic=True)
    fleet.register({"role": "prefill_decode", "url": "http://10.0.0.9:8000"})
    config = Config(dynamic_registration=True, admin_api_key="k", decode_urls=("dns://pd:8000",))
    found = Discovery(dns_names(config), fleet, Scripted({"pd": ["10.0.0.9", "10.0.0.8"]}), refresh_s=60)
    await found.resolve_now("dns://pd:8000")
    assert urls(fleet.all()) == ["http://10.0.0.9:8000", "http://10.0.0.8:8000"]
    assert (
        fleet.source("http://10.0.0.9:8000") == REGISTERED and fleet.source("http://10.0.0.8:8000") == "dns://pd:8000"
    )
    assert "registered" in found.status()["dns://pd:8000"]["left_out"]["http://10.0.0.9:8000"]


def test_registration_cannot_touch_what_a_name_or_the_command_line_owns():
    fleet = Registry(dynamic=True)
    assert fleet.discovered("dns://enc:1", "encode", ["http://10.0.0.1:1"]) == {}
    for action in (
        lambda: fleet.register({"role": "encode", "url": "http://10.0.0.1:1"}),
        lambda: fleet.register({"role": "prefill", "url": "http://10.0.0.1:1"}),
        lambda: fleet.unregister("http://10.0.0.1:1"),
    ):
        with pytest.raises(RegistryError, match="found through dns://enc:1") as err:
            action()
        assert err.value.status == 409
    fleet.forget("http://10.0.0.1:1", "out of rotation")  # --evicted-ttl: only registrations
    fleet.sync({})  # the shared roster holds registrations only
    assert urls(fleet.all()) == ["http://10.0.0.1:1"]
    # The registry's role rules hold for names as for registrations.
    fleet.register({"role": "prefill_decode", "url": "http://pd"})
    refused = fleet.discovered("dns://d:1", "decode", ["http://10.0.0.2:1"])
    assert "cannot mix" in refused["http://10.0.0.2:1"]
    static = Registry.from_config(Config(encode_urls=("http://e",), decode_urls=("http://d",)))
    with pytest.raises(RegistryError, match="listed on the command line"):
        static.unregister("http://e")


async def test_an_instance_failure_resolves_its_name_again_soon():
    found, fleet, _ = discovery({"enc": ["10.0.0.1"]}, refresh_s=60)
    health = Health()
    fleet.watch(health)
    health.on_unreachable(found.unreachable)
    await found.start()
    try:
        client = found._client
        asked = len(client.asked)
        client.answers["enc"] = ["10.0.0.2"]
        health.failed(fleet.members("encode")[0], "refused")  # well before the 60 s refresh
        await eventually(lambda: urls(fleet.members("encode")) == ["http://10.0.0.2:8000"], what="re-resolved")
        assert len(client.asked) == asked + 1
        health.failed(Instance("http://pd", "prefill_decode"), "refused")  # listed: no name to ask again
        assert not any(state.wake.is_set() for state in found._states.values())
    finally:
        await found.close()


def test_client_points_at_the_given_server():
    client = DnsClient("127.0.0.1:5353")
    assert (client._resolver.nameservers, client._resolver.port) == (["127.0.0.1"], 5353)
    assert client._resolver.cache is None and client._resolver.use_search_by_default


@pytest.mark.parametrize(
    "kwargs, complaint",
    [
        ({"encode_urls": ("dns://enc",)}, "needs a port"),
        ({"encode_urls": ("dns+srv://_x._tcp.enc:80",)}, "SRV records carry the ports"),
        ({"encode_urls": ("dns://enc:80/path",)}, "not a DNS name"),
        ({"encode_urls": ("dns://enc:99999",)}, "invalid port"),
        ({"encode_urls": ("dns://e:1",), "decode_urls": ("dns://e:1",)}, "listed twice"),
        ({"decode_urls": ("dns://d:1",), "ec_consumer_zmq_addrs": ("tcp://z:1",)}, "by position"),
        ({"dynamic_registration": True, "admin_api_key": "k", "encode_urls": ("http://e",)}, "not from listed URLs"),
        ({"dns_server": "dns.example:53"}, "IP address"),
    ],
)
def test_refused_combinations(kwargs, complaint):
    base = {"encode_urls": ("http://e",), "decode_urls": ("http://d",)}
    with pytest.raises(ConfigError, match=complaint):
        Config(**{**base, **kwargs})


def test_accepted_combinations():
    Config(encode_urls=("http://e0", "dns://enc:8000"), decode_urls=("dns+srv://_http._tcp.pd",))
    Config(dynamic_registration=True, admin_api_key="k", encode_urls=("dns://enc:8000",))
    Config(encode_urls=("dns://enc:1",), decode_urls=("dns://d:1",), ec_consumer_dp_size=2, dns_server="[::1]:53")
