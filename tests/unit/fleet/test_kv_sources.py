"""Reading vLLM's `/kv_event_sources` answer and `--kv-events-endpoints` (kv_sources.py, addresses.py)."""

from __future__ import annotations

import orjson
import pytest

from epd_proxy.config import Config, ConfigError
from epd_proxy.fleet.kv_events import Source
from epd_proxy.fleet.kv_sources import at_rank, given_sources, on_host, read_sources

E, P1, P2, D = "http://e:1", "http://p1:8000", "http://p2:8000", "http://d:8000"


def answer(**ranks) -> bytes:
    return orjson.dumps({rank.removeprefix("r"): settings for rank, settings in ranks.items()})


def test_an_engine_names_only_a_port_on_its_own_host():
    assert on_host("tcp://*:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert on_host("tcp://[::]:5557", "[fd00::1]") == "tcp://[fd00::1]:5557"
    assert on_host("tcp://0.0.0.0:5557", "pd-0.svc") == "tcp://pd-0.svc:5557"
    # vLLM names the address it bound `*:0` to: the same engine, reached by the name it has here.
    assert on_host("tcp://10.1.1.1:41234", "pd-0.svc") == "tcp://pd-0.svc:41234"
    # A backend that lies cannot send the proxy to another host (a metadata service, say).
    assert on_host("tcp://169.254.169.254:80", "pd-0.svc") == "tcp://pd-0.svc:80"
    # A local socket is the engine's only when the engine is on this machine.
    assert on_host("ipc:///tmp/kv", "127.0.0.1") == "ipc:///tmp/kv"
    assert on_host("ipc:///tmp/kv", "pd-0") is None
    assert on_host("tcp://*:http", "pd-0") is None


def test_vllms_answer_gives_a_source_per_rank():
    body = answer(
        r0={"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"},
        r1={"publisher": "zmq", "endpoint": "tcp://*:5558", "replay_endpoint": None, "topic": ""},
        r2={"publisher": "null", "endpoint": "tcp://*:5559"},
        r3={"publisher": "zmq", "endpoint": "http://nope"},
    )
    assert read_sources("http://[fd00::2]:8000", body) == {
        0: Source("tcp://[fd00::2]:5557", "tcp://[fd00::2]:5558", "kv"),
        1: Source("tcp://[fd00::2]:5558", None, ""),
    }
    assert read_sources(P1, b"{}") == {}


@pytest.mark.parametrize("body", [b"[]", b'{"zero": {}}', b'{"0": "tcp://*:1"}', b"not json"])
def test_an_answer_of_another_shape_is_refused(body):
    with pytest.raises(ValueError):
        read_sources(P1, body)


def test_given_endpoints_fill_the_host_and_put_rank_r_on_port_plus_r():
    assert at_rank("tcp://h:5557", 2) == "tcp://h:5559" and at_rank("tcp://h:0", 2) == "tcp://h:0"
    assert given_sources("tcp://{host}:5557+tcp://{host}:6000", "http://pd-1:8000", 2) == {
        0: Source("tcp://pd-1:5557", "tcp://pd-1:6000"),
        1: Source("tcp://pd-1:5558", "tcp://pd-1:6001"),
    }
    assert given_sources("tcp://x:1", P1, 1) == {0: Source("tcp://x:1", None)}


def test_the_endpoints_flag_lines_up_with_the_listed_consumers_or_is_one_template():
    listed = {"encode_urls": (E,), "prefill_urls": (P1, P2), "decode_urls": (D,)}
    Config(**listed, kv_events_endpoints=("tcp://p1:1+tcp://p1:2", "tcp://p2:1", "tcp://d:1"))
    Config(**listed, kv_events_endpoints=("tcp://{host}:5557",))
    with pytest.raises(ConfigError, match="has 2 entries; expected 3"):
        Config(**listed, kv_events_endpoints=("tcp://p1:1", "tcp://p2:1"))
    with pytest.raises(ConfigError, match="template holding"):
        Config(encode_urls=(E,), decode_urls=("dns://pd:8000",), kv_events_endpoints=("tcp://a:1",))
    with pytest.raises(ConfigError, match="not a ZMQ endpoint"):
        Config(**listed, kv_events_endpoints=("http://{host}:5557",))
    with pytest.raises(ConfigError, match="needs a host and a port"):
        Config(**listed, kv_events_endpoints=("tcp://{host}",))
