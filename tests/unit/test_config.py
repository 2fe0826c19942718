from __future__ import annotations

import pytest

from epd_proxy.cli import add_serve_arguments, config_from_args
from epd_proxy.config import Config, ConfigError, split_urls


def parse(*argv, env=None):
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return config_from_args(
        parser.parse_args(
            ["--encode-servers-urls", "http://e0,http://e1/", "--decode-servers-urls", "http://d0", *argv]
        ),
        env or {},
    )


@pytest.mark.parametrize("value", ["none", "disable", "", "  ", "NONE"])
def test_prefill_disabled_spellings(value):
    assert split_urls(value) == ()
    assert parse("--prefill-servers-urls", value).prefill_urls == ()


def test_reference_flags_and_env():
    config = parse(
        "--no-rewrite",
        "--decode-retries",
        "3",
        "--log-requests",
        env={"ENCODER_MAX_BATCH_SIZE": "2", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "30"},
    )
    assert config.encode_urls == ("http://e0", "http://e1")
    assert (config.rewrite, config.decode_retries, config.log_requests) == (False, 3, True)
    assert config.encoder_max_batch_size == 2
    assert config.pool_keep_alive_s == 15
    assert parse("--encoder-max-batch-size", "4", env={"ENCODER_MAX_BATCH_SIZE": "2"}).encoder_max_batch_size == 4


@pytest.mark.parametrize(
    "keep_alive, pooled", [("0.1", 0.05), ("1", 0.5), ("5", 2.5), ("30", 15), ("0", None), ("-1", None)]
)
def test_pool_lifetime_stays_below_the_servers(keep_alive, pooled):
    assert parse(env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": keep_alive}).pool_keep_alive_s == pooled


def test_media_hash_is_the_references_unless_asked():
    assert parse().media_hash == "sha256"
    assert parse("--media-hash", "blake3").media_hash == "blake3"


def test_negative_retries_clamp_to_zero():
    assert parse("--decode-retries", "-2").decode_retries == 0


@pytest.mark.parametrize(
    "kwargs, complaint",
    [
        ({"encoder_max_batch_size": -1}, "ENCODER_MAX_BATCH_SIZE"),
        ({"ec_consumer_zmq_addrs": ("tcp://a:1",), "prefill_urls": ("http://p",)}, "E\\+PD only"),
        ({"ec_consumer_zmq_addrs": ("tcp://a:1",), "ec_consumer_dp_size": 2}, "expected 2"),
        ({"ec_consumer_dp_size": 0}, "dp-size"),
        ({"decode_urls": ()}, "decode"),
        ({"media_hash": "md5"}, "--media-hash must be one of blake3, sha256"),
    ],
)
def test_invalid_topologies_fail_at_startup(kwargs, complaint):
    base = {"encode_urls": ("http://e",), "decode_urls": ("http://d",)}
    with pytest.raises(ConfigError, match=complaint):
        Config(**{**base, **kwargs})


def test_bad_env_number_is_a_config_error():
    with pytest.raises(ConfigError, match="ENCODER_MAX_BATCH_SIZE"):
        parse(env={"ENCODER_MAX_BATCH_SIZE": "many"})


def test_cli_exits_with_a_message_on_bad_topology(capsys):
    from epd_proxy.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "serve",
                "--encode-servers-urls",
                "http://e",
                "--decode-servers-urls",
                "http://d",
                "--ec-consumer-zmq-addrs",
                "tcp://a:1",
                "--prefill-servers-urls",
                "http://p",
            ]
        )
    assert exit_info.value.code == 2
    assert "E+PD only" in capsys.readouterr().err


def test_outlier_detection_flags():
    config = parse("--ejection-time", "5", "--max-ejection-time", "40", "--max-ejection-percent", "25")
    assert (config.ejection_time_s, config.max_ejection_time_s, config.max_ejection_percent) == (5, 40, 25)
    defaults = parse()
    assert (defaults.ejection_time_s, defaults.max_ejection_percent) == (30, 50)
    assert (defaults.consecutive_5xx, defaults.consecutive_gateway_failure) == (5, 5)
    config = parse("--consecutive-5xx", "0", "--consecutive-gateway-failure", "3")
    assert (config.consecutive_5xx, config.consecutive_gateway_failure) == (0, 3)


@pytest.mark.parametrize(
    "kwargs, complaint",
    [
        ({"ejection_time_s": 0}, "--ejection-time"),
        ({"max_ejection_percent": 101}, "--max-ejection-percent"),
        ({"consecutive_5xx": -1}, "--consecutive-5xx"),
        ({"consecutive_gateway_failure": -1}, "--consecutive-gateway-failure"),
    ],
)
def test_outlier_detection_limits(kwargs, complaint):
    with pytest.raises(ConfigError, match=complaint):
        Config(encode_urls=("http://e",), decode_urls=("http://d",), **kwargs)
