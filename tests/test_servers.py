"""The test harness's servers end with the test process, even one killed before its fixtures stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.servers import ending_with_the_tests

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


@pytest.mark.parametrize("guarded", [True, False])
def test_a_server_started_for_tests_ends_when_the_test_process_is_killed(tmp_path, guarded):
    """A test process killed (SIGKILL: no fixture teardown) takes its servers with it; without `setpriv
    --pdeathsig` (the harness before), the server, in its own session, outlives it."""
    if ending_with_the_tests(["x"]) == ["x"]:
        pytest.skip("no setpriv on this machine: servers are stopped by the fixtures only")
    script = _TESTS_PROCESS.format(repo=str(Path(__file__).resolve().parents[1]), log=str(tmp_path / "log"))
    if not guarded:  # the broken harness: no parent-death signal
        script = script.replace("from tests.servers import Started",
                                "import tests.servers as s; s.ending_with_the_tests = list; Started = s.Started")
    tests = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert tests.stdout is not None
    server = int(tests.stdout.readline())
    try:
        assert _alive(server)
        tests.send_signal(signal.SIGKILL)
        tests.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _alive(server) is not guarded, "the server outlived the killed test process" if guarded else ""
    finally:
        if _alive(server):
            os.killpg(server, signal.SIGKILL)
