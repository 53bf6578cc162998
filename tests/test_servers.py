"""The test harness's servers end with the test process, even one killed before its fixtures stop them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.servers import cmdline, ending_with_the_tests

_TESTS_PROCESS = """
import subprocess, sys, time
sys.path.insert(0, {repo!r})
from tests.servers import Started
server = Started([sys.executable, "-c", "import time; time.sleep(600)", "--port", "1"], {log!r})
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[0] if Path(f"/proc/{pid}").exists() else "X"
    return status != "Z"


def _state(pid: int) -> str:
    """What the failure message needs: the process's command line and its signal masks."""
    try:
        status = [ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith(("State", "Sig"))]
        return f"{cmdline(pid)!r} {status}"
    except OSError:
        return "(gone)"


# `setpriv` run a second late, as a loaded machine might: the test process is killed inside the window between
# Popen's return and `setpriv` asking for the parent-death signal.
_SLOW_SETPRIV = "#!/bin/sh\nsleep 1\nexec {real} \"$@\"\n"


@pytest.mark.parametrize(("harness", "killed"), [
    ("guarded", "once it runs"), ("guarded", "as it starts"),
    ("no parent-death signal", "once it runs"), ("no parent check", "as it starts"),
])  # fmt: skip
def test_a_server_started_for_tests_ends_when_the_test_process_is_killed(tmp_path, harness, killed):
    """A test process killed (SIGKILL: no fixture teardown) takes its server with it: once the server runs, and
    right after it started one (`setpriv` still starting). Two broken harnesses fail: without `setpriv --pdeathsig`
    (the harness before) the server, in its own session, outlives it; and so it does with `setpriv` alone, killed
    before `setpriv` asked for the signal (the CI failure of 2026-12-07), where nothing checks afterwards that the
    test process is still there."""
    if ending_with_the_tests(["x"]) == ["x"]:
        pytest.skip("no setpriv on this machine: servers are stopped by the fixtures only")
    script = _TESTS_PROCESS.format(repo=str(Path(__file__).resolve().parents[1]), log=str(tmp_path / "log"))
    if harness == "no parent-death signal":
        script = script.replace("from tests.servers import Started",
                                "import tests.servers as s; s.ending_with_the_tests = list; Started = s.Started")
    elif harness == "no parent check":
        script = script.replace("from tests.servers import Started",
                                "import tests.servers as s; "
                                "s.ending_with_the_tests = lambda c: ['setpriv', '--pdeathsig', 'TERM', '--', *c]; "
                                "Started = s.Started")
    env = dict(os.environ)
    if killed == "as it starts":
        slow = tmp_path / "bin" / "setpriv"
        slow.parent.mkdir()
        slow.write_text(_SLOW_SETPRIV.format(real=shutil.which("setpriv")))
        slow.chmod(0o755)
        env["PATH"] = f"{slow.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    tests = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert tests.stdout is not None
    server = int(tests.stdout.readline())
    try:
        assert _alive(server)
        if killed == "once it runs":
            deadline = time.monotonic() + 30
            runs = sys.executable.encode() + b"\0-c\0"  # the server itself, past setpriv and the shell's check
            while not cmdline(server).startswith(runs) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert cmdline(server).startswith(runs), cmdline(server)
        tests.send_signal(signal.SIGKILL)
        tests.wait(timeout=10)
        deadline = time.monotonic() + (10 if harness == "guarded" else 2.5)  # (the slow setpriv done by then)
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        if harness == "guarded":
            assert not _alive(server), f"the server outlived the killed test process: {_state(server)}"
        else:
            assert _alive(server), "a broken harness's server ended with the test process"
    finally:
        if _alive(server):
            os.killpg(server, signal.SIGKILL)
