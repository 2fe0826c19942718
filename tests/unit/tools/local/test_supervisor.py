"""The local stack's process helpers (supervisor.py): ports and health on loopback."""

from __future__ import annotations

import socket

import pytest

from epd_proxy_tools.local.supervisor import StackError, find_free_port_block, http_ok, port_free
from epd_proxy_tools.testing.harness import free_port


def test_a_listening_port_is_not_free_and_a_block_skips_it():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not port_free("127.0.0.1", port)
        base = find_free_port_block(3, start=port - 1, stop=port + 40)
        assert base > port and all(port_free("127.0.0.1", base + i) for i in range(3))


def test_no_block_in_a_range_too_small_is_an_error():
    with pytest.raises(StackError):
        find_free_port_block(5, start=20000, stop=20004)


def test_a_port_nobody_listens_on_is_not_ok():
    assert not http_ok(f"http://127.0.0.1:{free_port()}/health", timeout=2)
    assert not http_ok("not a url")
