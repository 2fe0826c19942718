"""The aiohttp range pyproject.toml allows is the one the server was tested with, and an aiohttp
without the internals the server uses is refused at startup, by name."""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.web_server import Server
from packaging.requirements import Requirement

from epd_proxy.http import server

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def aiohttp_requirement() -> Requirement:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (requirement,) = (Requirement(d) for d in dependencies if Requirement(d).name == "aiohttp")
    return requirement


def test_pyproject_pins_the_range_the_server_checks_and_the_installed_aiohttp_is_in_it():
    requirement = aiohttp_requirement()
    assert str(requirement.specifier) == str(Requirement(f"aiohttp{server.AIOHTTP_RANGE}").specifier)
    # An upper bound: the internals are private, so an untested minor release is not assumed to work.
    assert any(spec.operator == "<" for spec in requirement.specifier)
    assert requirement.specifier.contains(aiohttp.__version__), aiohttp.__version__


async def test_the_installed_aiohttp_has_every_internal_the_server_uses():
    server.check_aiohttp(Server(lambda request: web.Response()))


async def test_a_missing_internal_is_refused_by_name():
    present = {name: None for name in server._SERVER_INTERNALS if name != "handler_cancellation"}
    with pytest.raises(RuntimeError, match=r"lacks .*\(Server\.handler_cancellation\); install aiohttp>=3\.14\.4"):
        server.check_aiohttp(SimpleNamespace(**present))

    class OldServer(Server):
        def __call__(self):
            handler = super().__call__()
            return SimpleNamespace(
                **{n: getattr(handler, n) for n in server._HANDLER_INTERNALS if n != "_buffer_paused"}
            )

    with pytest.raises(RuntimeError, match=r"\(RequestHandler\._buffer_paused\)"):
        server.check_aiohttp(OldServer(lambda request: web.Response()))
