"""The local stack on the production transports: what each engine is started with (no vLLM)."""

from __future__ import annotations

import json
import os

import pytest

from epd_proxy.options import ConfigError
from epd_proxy_tools.local.stack import ENGINE_PATCHES, LocalStack, StackConfig


def flag(cmd: list[str], name: str) -> dict:
    return json.loads(cmd[cmd.index(name) + 1])


def test_mooncake_consumers_listen_where_the_proxy_tells_encoders_to_push():
    st = LocalStack(StackConfig(encoders=2, consumers=2, ec_connector="mooncake", base_port=9200))
    ec = {m.name: flag(m.cmd, "--ec-transfer-config") for m in st.instances}
    assert {c["ec_connector"] for c in ec.values()} == {"ECMooncakeConnector"}
    assert [ec[n]["ec_role"] for n in ("encoder-0", "encoder-1", "pd", "pd-1")] == ["ec_producer"] * 2 + [
        "ec_consumer"
    ] * 2
    assert all(
        c["ec_ip"] == "127.0.0.1" and c["ec_connector_extra_config"]["mooncake_protocol"] == "tcp" for c in ec.values()
    )
    ports = [c["ec_port"] for c in ec.values()]
    assert len(set(ports)) == 4 and min(ports) == 9400
    zmq = st.proxy.cmd[st.proxy.cmd.index("--ec-consumer-zmq-addrs") + 1].split(",")
    decode = st.proxy.cmd[st.proxy.cmd.index("--decode-servers-urls") + 1].split(",")
    # Matched by position, as the reference matches them.
    assert decode == st.consumer_urls
    assert zmq == [f"tcp://127.0.0.1:{ec[n]['ec_port']}" for n in ("pd", "pd-1")]
    assert st.common_env()["VLLM_HOST_IP"] == "127.0.0.1"


def test_only_mooncake_consumers_get_the_engine_patch():
    st = LocalStack(StackConfig(encoders=1, baseline=True, ec_connector="mooncake"))
    paths = {m.name: m.env_overrides.get("PYTHONPATH", "") for m in st.instances}
    assert paths["pd"].split(os.pathsep)[0] == str(ENGINE_PATCHES)
    assert str(ENGINE_PATCHES) not in paths["encoder-0"] + paths["baseline"]
    folder = LocalStack(StackConfig(encoders=1))
    assert all("PYTHONPATH" not in m.env_overrides for m in folder.instances)


def test_a_consumer_per_data_parallel_rank_gets_its_own_address():
    st = LocalStack(StackConfig(encoders=1, ec_connector="mooncake", extra_vllm_args=("--data-parallel-size", "2")))
    cmd = st.proxy.cmd
    pd_port = flag(st.by_name("pd").cmd, "--ec-transfer-config")["ec_port"]
    assert cmd[cmd.index("--ec-consumer-zmq-addrs") + 1] == f"tcp://127.0.0.1:{pd_port},tcp://127.0.0.1:{pd_port + 1}"
    assert cmd[cmd.index("--ec-consumer-dp-size") + 1] == "2"


def test_nixl_prefill_and_decode_each_get_a_side_channel_of_their_own():
    st = LocalStack(StackConfig(encoders=2, prefill=True, kv_connector="nixl", base_port=9200))
    kv = {m.name: flag(m.cmd, "--kv-transfer-config") for m in st.instances if "--kv-transfer-config" in m.cmd}
    assert kv == {
        "prefill": {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"},
        "decode": {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"},
    }
    env = {m.name: m.env_overrides for m in st.instances}
    side = [env[n]["VLLM_NIXL_SIDE_CHANNEL_PORT"] for n in ("prefill", "decode")]
    assert len(set(side)) == 2 and all(env[n]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" for n in kv)
    assert all(env[n]["UCX_NET_DEVICES"] == "lo" for n in kv)
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env["encoder-0"]
    # The encoder output still goes through the folder.
    assert flag(st.by_name("decode").cmd, "--ec-transfer-config")["ec_connector"] == "ECExampleConnector"


@pytest.mark.parametrize(
    "config, complaint",
    [
        (dict(ec_connector="mooncake", prefill=True), r"E\+PD only"),
        (dict(kv_connector="nixl"), "needs --prefill"),
        (dict(ec_connector="nixl"), "invalid choice"),
    ],
)
def test_combinations_the_proxy_cannot_serve_are_refused_before_anything_starts(config, complaint):
    with pytest.raises(ConfigError, match=complaint):
        StackConfig(**config)


def test_a_taken_transfer_port_is_named_before_anything_is_built(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        st = LocalStack(StackConfig(encoders=1, ec_connector="mooncake", work_dir=tmp_path, transfer_port=port))
        with pytest.raises(Exception, match=f"encoder-0 transfer:{port}"):
            st.prepare()
