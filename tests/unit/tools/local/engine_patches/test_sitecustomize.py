"""The Mooncake consumer fix the local stack puts on a consumer's PYTHONPATH, against stand-ins
for vLLM's runner module, each in a process of its own (no vLLM)."""

from __future__ import annotations

import os
import subprocess
import sys

from epd_proxy_tools.local.stack import ENGINE_PATCHES


def _run_patch(runner_source: str, tmp_path) -> subprocess.CompletedProcess:
    """sitecustomize.py in a process whose `vllm.v1.worker.gpu_model_runner` is `runner_source`."""
    pkg = tmp_path / "vllm" / "v1" / "worker"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "v1", pkg):
        (d / "__init__.py").write_text("")
    (tmp_path / "vllm" / "distributed").mkdir()
    (tmp_path / "vllm" / "distributed" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "distributed" / "ec_transfer.py").write_text(
        "def has_ec_transfer(): return True\nclass _C: is_consumer = True\ndef get_ec_transfer(): return _C()\n"
    )
    (tmp_path / "vllm" / "v1" / "outputs.py").write_text(
        "class ModelRunnerOutput:\n"
        "    ec_connector_output = None\n"
        "    @staticmethod\n"
        "    def with_ec_conn_output(out, ec):\n"
        "        out.ec_connector_output = ec\n"
        "        return out\n"
    )
    (pkg / "gpu_model_runner.py").write_text(runner_source)
    probe = (
        "import types, vllm.v1.worker.gpu_model_runner as m\n"
        "r = m.GPUModelRunner()\n"
        "s = types.SimpleNamespace(total_num_scheduled_tokens=0, ec_connector_metadata=object())\n"
        "print('wrapped' if hasattr(m.GPUModelRunner.execute_model, '__wrapped__') else 'left alone')\n"
        "print(r.execute_model(s).ec_connector_output)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ENGINE_PATCHES), str(tmp_path)])}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)


RUNNER_032 = """
import contextlib
from vllm.v1.outputs import ModelRunnerOutput
class GPUModelRunner:
    encoder_cache = {}
    @contextlib.contextmanager
    def maybe_get_ec_connector_output(self, scheduler_output, encoder_cache):
        yield "loaded"
    def execute_model(self, scheduler_output):
        num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        if False:
            with self.maybe_get_ec_connector_output(scheduler_output, encoder_cache=self.encoder_cache):
                pass
        if not num_scheduled_tokens:
            return ModelRunnerOutput()
"""


def test_the_engine_patch_loads_pushes_on_zero_token_steps_of_a_runner_shaped_like_0_32(tmp_path):
    done = _run_patch(RUNNER_032, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["wrapped", "loaded"]
    assert "EC consumer patch applied" in done.stderr


def test_the_engine_patch_leaves_a_runner_that_loads_on_such_steps_alone(tmp_path):
    fixed = RUNNER_032.replace(
        "        if not num_scheduled_tokens:\n",
        "        if not num_scheduled_tokens:\n"
        "            with self.maybe_get_ec_connector_output(scheduler_output, encoder_cache=self.encoder_cache):\n"
        "                pass\n",
    )
    done = _run_patch(fixed, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["left", "alone", "None"]
    assert "not applied" in done.stderr
