"""Starting and killing the real daemons the tests run (daemon.py), with a stand-in command."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from epd_proxy_tools.testing.daemon import find_binary, kill_daemon, start_daemon

SLEEPER = [sys.executable, "-c", "import sys, time; print('up', flush=True); time.sleep(60)"]


def test_a_missing_binary_names_its_package_and_a_fallback_that_exists_is_taken():
    with pytest.raises(RuntimeError, match="apt-get install some-package"):
        find_binary("no-such-daemon-here", "some-package")
    assert find_binary("no-such-daemon-here", "some-package", fallback=sys.executable) == sys.executable


def test_a_daemon_is_returned_once_it_answers_and_killed_outright(tmp_path):
    log = tmp_path / "d.log"
    answered = []
    proc = start_daemon(SLEEPER, log, lambda: len(answered) > 2 or answered.append(1), timeout_s=10)
    try:
        assert proc.poll() is None and len(answered) == 3
    finally:
        kill_daemon(proc)
    assert proc.returncode == -9
    kill_daemon(proc)  # already gone: nothing to do
    kill_daemon(None)


def test_a_daemon_that_exits_or_never_answers_is_an_error_naming_its_log(tmp_path):
    log = tmp_path / "d.log"
    with pytest.raises(RuntimeError, match=str(log)):
        start_daemon([sys.executable, "-c", "raise SystemExit(3)"], log, lambda: False, timeout_s=10)


def test_a_daemon_that_never_answers_is_not_left_running(tmp_path):
    pid_file = tmp_path / "pid"
    write_pid = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    with pytest.raises(RuntimeError, match="did not answer within 5s"):
        start_daemon([sys.executable, "-c", write_pid], tmp_path / "d.log", lambda: False, timeout_s=5)
    pid = int(pid_file.read_text())
    assert not Path(f"/proc/{pid}").exists(), "killed and reaped"
