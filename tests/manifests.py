"""deploy/'s manifests as `kubectl apply -k` renders them, for the tests that check them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
OVERLAYS = ("e-pd", "e-p-d")


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (for `kubectl kustomize`) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY / overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def proxy_container(docs: list[dict]) -> dict:
    (container,) = by_kind(docs, "Deployment")["epd-proxy"]["spec"]["template"]["spec"]["containers"]
    return container
