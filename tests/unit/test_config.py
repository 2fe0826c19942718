from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from epd_proxy import config as config_module
from epd_proxy.addresses import split_urls
from epd_proxy.cli import add_serve_arguments, config_from_args
from epd_proxy.config import (
    ENCODE_POLICIES,
    MEDIA_HASH_NAMES,
    SERVING_POLICIES,
    Config,
    ConfigError,
    options,
)
from epd_proxy_tools.flag_tables import table


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


def test_connect_timeout_has_a_flag():
    assert parse().connect_timeout_s == 10
    assert parse("--connect-timeout", "2.5").connect_timeout_s == 2.5


@pytest.mark.parametrize(
    "kwargs, complaint",
    [
        ({"encoder_max_batch_size": -1}, "ENCODER_MAX_BATCH_SIZE"),
        ({"ec_consumer_zmq_addrs": ("tcp://a:1",), "prefill_urls": ("http://p",)}, "E\\+PD only"),
        ({"ec_consumer_zmq_addrs": ("tcp://a:1",), "ec_consumer_dp_size": 2}, "expected 2"),
        ({"ec_consumer_dp_size": 0}, "dp-size"),
        ({"decode_urls": ()}, "decode"),
        ({"media_hash": "md5"}, "argument --media-hash: invalid choice: 'md5' \\(choose from sha256, blake3\\)"),
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


SERVE_PAGE = Path(__file__).resolve().parents[2] / "docs" / "serve.md"
# Settings read only from the environment, as the reference proxy and vLLM read them: the admin
# and profiling keys (secrets stay out of the process list) and the backends' own keep-alive.
ENV_ONLY = {"admin_api_key", "profile_api_key", "backend_keep_alive_s"}


def test_the_docs_table_is_the_declarations():
    text = SERVE_PAGE.read_text()
    start = text.index("| Flag / env | Default | Meaning |")
    end = text.index("<!-- end of the generated table -->")
    assert text[start:end] == table("serve"), (
        "regenerate docs/serve.md's table with: python -m epd_proxy_tools.flag_tables serve"
    )


def test_every_field_is_an_option_with_a_flag_unless_read_from_the_environment():
    declared = options()
    assert [name for name, _, _ in declared] == [item.name for item in dataclasses.fields(Config)]
    assert all(option.help for _, _, option in declared)
    assert {name for name, _, option in declared if option.flag is None} == ENV_ONLY
    assert all(option.env for name, _, option in declared if name in ENV_ONLY)
    flags = [option.flag for _, _, option in declared if option.flag]
    envs = [option.env for _, _, option in declared if option.env]
    assert len(flags) == len(set(flags)) and len(envs) == len(set(envs))


def test_flags_not_given_leave_the_fields_defaults():
    assert parse() == Config(encode_urls=("http://e0", "http://e1"), decode_urls=("http://d0",))


FLAG_AND_ENV = [
    ("encoder_max_batch_size", "--encoder-max-batch-size", "ENCODER_MAX_BATCH_SIZE", ("2", 2), ("4", 4)),
    ("api_key", "--api-key", "EPD_API_KEY", ("from-env", "from-env"), ("from-flag", "from-flag")),
    ("backend_api_key", "--backend-api-key", "EPD_BACKEND_API_KEY", ("from-env", "from-env"), ("f", "f")),
]


def test_every_option_with_a_flag_and_an_environment_variable_is_below():
    both = {(name, option.flag, option.env) for name, _, option in options() if option.flag and option.env}
    assert both == {row[:3] for row in FLAG_AND_ENV}


@pytest.mark.parametrize("name, flag, env, from_env, from_flag", FLAG_AND_ENV)
def test_a_flag_wins_over_its_environment_variable(name, flag, env, from_env, from_flag):
    assert getattr(parse(env={env: from_env[0]}), name) == from_env[1]
    assert getattr(parse(flag, from_flag[0], env={env: from_env[0]}), name) == from_flag[1]


def test_a_key_from_the_environment_is_taken_as_written():
    assert parse(env={"EPD_API_KEY": " k "}).api_key == " k "
    assert parse(env={"ENCODER_MAX_BATCH_SIZE": " "}).encoder_max_batch_size == 0


def test_switches():
    assert (parse().rewrite, parse("--no-rewrite").rewrite) == (True, False)
    assert (parse().trust_client_fields, parse("--trust-client-fields").trust_client_fields) == (False, True)


@pytest.mark.parametrize(
    "flag, text, field, value",
    [
        ("--decode-retries", "-5", "decode_retries", -5),
        ("--ejection-time", "0", "ejection_time_s", 0.0),
        ("--fail-threshold", "0", "fail_threshold", 0),
        ("--encode-timeout", "-1", "encode_timeout_s", -1.0),
        ("--log-format", "xml", "log_format", "xml"),
        ("--decode-servers-urls", "d:1", "decode_urls", ("d:1",)),
    ],
)
def test_a_value_is_checked_once_with_one_message(flag, text, field, value, capsys):
    """The command line only parses: the limits are the field's, so code and flags fail alike."""
    base = {"encode_urls": ("http://e0", "http://e1"), "decode_urls": ("http://d0",)}
    with pytest.raises(ConfigError) as refused:
        Config(**{**base, field: value})
    from epd_proxy.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(
            ["serve", "--encode-servers-urls", "http://e0,http://e1", "--decode-servers-urls", "http://d0", flag, text]
        )
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith(f"epd-proxy serve: error: {refused.value}\n")


def test_a_stage_limit_of_zero_is_none():
    config = parse(
        "--encode-timeout", "0", "--prefill-timeout", "0", "--decode-timeout", "0", "--stream-idle-timeout", "0"
    )
    assert (config.encode_timeout_s, config.prefill_timeout_s, config.decode_timeout_s) == (None, None, None)
    assert config.stream_idle_timeout_s is None


def test_every_choice_has_an_implementation():
    from epd_proxy.fleet.routing import POLICIES, SERVING
    from epd_proxy.journey.extract import MEDIA_HASHES

    assert set(MEDIA_HASH_NAMES) == set(MEDIA_HASHES)
    assert set(ENCODE_POLICIES) | set(SERVING_POLICIES) <= set(POLICIES)
    assert set(SERVING) == set(SERVING_POLICIES), "prefill and decode choose from policies that take a missing key"


def _imported_from_the_package(module) -> set[str]:
    tree = ast.parse(Path(module.__file__).read_text())
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "epd_proxy"
        for alias in node.names
    ]
    return {name for name in imported if name and name.startswith("epd_proxy") and name != "epd_proxy"}


def test_the_configuration_depends_on_no_component():
    """Only on the option machinery, the address kinds, its declaration parts and the tenants
    file's reading, which themselves depend on nothing else (errors.py aside)."""
    from epd_proxy import addresses, fetch_flags, options, tenants

    assert _imported_from_the_package(config_module) == {
        "epd_proxy.options",
        "epd_proxy.addresses",
        "epd_proxy.fetch_flags",
        "epd_proxy.reference_flags",
        "epd_proxy.tenants",
    }
    assert _imported_from_the_package(fetch_flags) == {
        "epd_proxy.options",
        "epd_proxy.addresses",
        "epd_proxy.reference_flags",
    }
    assert _imported_from_the_package(addresses) == {"epd_proxy.options"}
    assert _imported_from_the_package(tenants) == {
        "epd_proxy.options",
        "epd_proxy.errors",
        "epd_proxy.addresses",
        "epd_proxy.fetch_flags",
        "epd_proxy.reference_flags",
    }
    assert _imported_from_the_package(options) == set()


@pytest.mark.parametrize(
    "flags", [{"kv_events": False}, {"prefill_policy": "least_loaded", "decode_policy": "least_loaded"}]
)
def test_render_urls_without_what_reads_a_rendered_prompt_is_refused(flags):
    with pytest.raises(ConfigError, match="--render-urls"):
        Config(encode_urls=("http://e",), decode_urls=("http://pd",), render_urls=("http://r",), **flags)
