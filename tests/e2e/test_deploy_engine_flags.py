"""The vLLM engines of deploy/'s manifests: their flags as vLLM's own `serve` parser reads them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.manifests import OVERLAYS, by_kind, render

VLLM_CHECK = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
for name, args in json.loads(sys.argv[1]).items():
    ns = make_arg_parser(FlexibleArgumentParser(prog=name)).parse_args(args)
    print(name, ns.model_tag, ns.ec_transfer_config.ec_role, ns.kv_transfer_config and ns.kv_transfer_config.kv_connector)
"""


def test_the_engine_flags_are_vllm_serves():
    """vLLM's own `serve` parser reads each engine's arguments (a typo or a flag of another vLLM
    release exits 2) and its connector configs; in a process of its own, as importing vLLM is heavy."""
    pytest.importorskip("vllm")
    engines = {}
    for overlay in OVERLAYS:
        for name, deployment in by_kind(render(overlay), "Deployment").items():
            (container,) = deployment["spec"]["template"]["spec"]["containers"]
            if name != "epd-proxy":
                assert container["command"] == ["vllm", "serve"]
                engines[name] = [str(arg) for arg in container["args"]]
                ec = json.loads(engines[name][engines[name].index("--ec-transfer-config") + 1])
                assert ec["ec_connector_extra_config"]["shared_storage_path"] == "/ec-store"
    out = subprocess.run(
        [sys.executable, "-c", VLLM_CHECK, json.dumps(engines)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"{engines}\n{out.stderr[-3000:]}"
    seen = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines() if line.startswith("epd-")}
    assert seen == {
        "epd-encoder": ["Qwen/Qwen2.5-VL-3B-Instruct", "ec_producer", "None"],
        "epd-pd": ["Qwen/Qwen2.5-VL-3B-Instruct", "ec_consumer", "None"],
        "epd-prefill": ["Qwen/Qwen2.5-VL-3B-Instruct", "ec_consumer", "NixlConnector"],
        "epd-decode": ["Qwen/Qwen2.5-VL-3B-Instruct", "ec_consumer", "NixlConnector"],
    }
