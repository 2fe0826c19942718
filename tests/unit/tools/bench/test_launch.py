"""Starting an arm (launch.py): its command runs with this interpreter, and readiness is polled."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from epd_proxy_tools.bench.launch import CHECKOUT, command_words, http_get, wait_ready


def test_our_proxy_and_a_bare_python_run_with_this_interpreter_and_others_as_typed():
    assert command_words(["epd-proxy", "serve", "--port", "1"]) == [
        sys.executable,
        "-m",
        "epd_proxy",
        "serve",
        "--port",
        "1",
    ]
    assert command_words(["python3", "ref.py"]) == [sys.executable, "ref.py"]
    assert command_words(["vllm", "serve"]) == ["vllm", "serve"]
    assert (Path(CHECKOUT) / "tools" / "epd_proxy_tools" / "bench" / "launch.py").exists()


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def test_a_process_that_answers_is_ready_and_one_that_exits_first_is_an_error():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/models"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        wait_ready(url, alive, deadline_s=10)
        assert http_get(url) == b"ok"
    finally:
        alive.kill()
        alive.wait()
        server.shutdown()
        server.server_close()
    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    gone.wait()
    with pytest.raises(RuntimeError, match="exited with status 3"):
        wait_ready(url, gone, deadline_s=10)
