"""Starting and stopping real servers for tests: a free loopback port, a process group, a readiness wait."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

START_TIMEOUT_S = 420  # a loaded 2-core machine can take minutes


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def models_answer(url: str, api_key: str | None = None) -> list[str] | None:
    """The model ids the server at `url` serves, or None while it does not answer."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models", headers=headers), timeout=2) as response:
            return [m["id"] for m in json.load(response)["data"]]
    except (OSError, urllib.error.URLError, ValueError, KeyError):
        return None


def stop(proc: subprocess.Popen) -> None:
    """Stop the server and everything it started (it runs in its own process group)."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def in_background(command: Sequence[str]) -> list[str]:
    """`command` at the lowest CPU priority, it and all it starts (the process keeps the pid `nice` had)."""
    return ["nice", "-n", "19", *command]


def ending_with_the_tests(command: Sequence[str]) -> list[str]:
    """`command`, sent SIGTERM should the test process die without stopping it (killed, not ended: fixtures' own
    teardown stops it otherwise). A server runs in its own session, so nothing else ends it: a test run killed
    once left its two session servers and their engines (6 GB) running for an hour. By `setpriv --pdeathsig`
    (util-linux), where the machine has it; the process keeps the pid `setpriv` had. (The signal follows the
    thread that started the server: these are started by pytest's main thread.)

    `setpriv` asks for the signal a moment after Popen returns: a test process killed in that moment sent none, and
    its server ran on (19 of 100 kills right after Popen on this idle 2-core machine; CI failed so twice). So a
    shell between `setpriv` and the command checks, once the signal is asked for, that this process is still its
    parent, and ends if not, as `supervise` does. (A wait in Popen's caller for `setpriv` to be done lost the same
    race beside servers starting: the process's command line reads empty while an exec replaces it, and its name is
    still the caller's as Popen returns.)"""
    if not shutil.which("setpriv"):
        return list(command)
    check = f'[ "$PPID" = {os.getpid()} ] || exit 143; exec "$@"'
    return ["setpriv", "--pdeathsig", "TERM", "--", "sh", "-c", check, "sh", *command]


class Started:
    """A server process started in its own process group (its output to `log`), answering on the `--port` of its
    command once it is up. Started ahead of need (`ahead`: at the lowest CPU priority; tests/conftest.py, "ahead
    of need") or when a fixture wants it; `running_server` waits for it."""

    def __init__(
        self, command: Sequence[str], log: Path, env: Mapping[str, str] | None = None, ahead: bool = False
    ):
        self.command = list(command)
        self.log = log
        self.url = f"http://127.0.0.1:{self.command[self.command.index('--port') + 1]}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                ending_with_the_tests(in_background(self.command) if ahead else self.command), stdout=out,
                stderr=subprocess.STDOUT, env=dict(env) if env else None, start_new_session=True,
            )  # fmt: skip


@contextlib.contextmanager
def running_server(
    command: Sequence[str] | Started, log_path: Path | None, what: str, env: Mapping[str, str] | None = None,
    api_key: str | None = None,
) -> Iterator[subprocess.Popen]:
    """Start `command` (an OpenAI-compatible server) in its own process group, or take one already `Started`,
    wait until `/v1/models` answers on the `--port` it was given (with `api_key`, for a server that wants one),
    and stop it afterwards. Fails the test with the log's tail."""
    started = command if isinstance(command, Started) else Started(command, log_path, env)  # type: ignore[arg-type]
    proc, log_path = started.proc, started.log
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while models_answer(started.url, api_key) is None:
            if proc.poll() is not None:
                pytest.fail(f"{what} exited with {proc.returncode}:\n{log_tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(f"{what} did not answer within {START_TIMEOUT_S} s:\n{log_tail(log_path)}")
            time.sleep(1)
        yield proc
    finally:
        stop(proc)


class SpanqServe:
    """A running `spanq serve`: its base URL, its log, the name it serves the model as, its API server's pid."""

    def __init__(self, url: str, log: Path, served_name: str, pid: int = 0):
        self.url = url
        self.log = log
        self.served_name = served_name
        self.pid = pid

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


def cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def wait_for(what: str, found: Callable[[], Any], timeout_s: float, log: Path | None = None) -> Any:
    """`found()` once it is true; fails the test (with the log's tail) if it is not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := found()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s" + (f"\n{log_tail(log)}" if log else ""))
        time.sleep(0.2)
    return value


class Supervised:
    """`spanq serve` run through `supervise`, as a cluster replica (`SpanReplica`) runs it: the supervisor's
    process, the server's pid, its URL and log (the supervisor's output and everything under it)."""

    def __init__(self, supervisor: subprocess.Popen, server: int, url: str, log: Path):
        self.supervisor, self.server, self.url, self.log = supervisor, server, url, log

    def alive(self) -> bool:
        return self.supervisor.poll() is None

    def healthy(self) -> bool:
        """True once the server answers; fails the test if its supervisor has exited."""
        if not self.alive():
            pytest.fail(f"spanq serve exited with {self.supervisor.returncode}:\n{log_tail(self.log)}")
        with contextlib.suppress(OSError, urllib.error.URLError), urllib.request.urlopen(
            f"{self.url}/health", timeout=2
        ) as answer:
            return answer.status == 200
        return False

    def kill_group(self) -> None:
        """Whatever is left of its process group, killed (the group `supervise` made outlives its leader)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.supervisor.pid, signal.SIGKILL)
        self.supervisor.wait()


def start_supervised(model: Path | str, log: Path, *args: str) -> Supervised:
    """`supervise` running `spanq serve --model MODEL ARGS...` in vLLM's default engine mode (the engine core in a
    process of its own), as `SpanReplica` starts it; returns once the server's process exists, not once it
    answers (`Supervised.healthy`)."""
    from spanq_backend.cluster.supervise import PARENT_ENV
    from spanq_backend.serving.processes import processes

    port = free_port()
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default, as a replica runs
    env[PARENT_ENV] = str(os.getpid())  # as a replica names itself to its supervisor
    command = [sys.executable, "-m", "spanq_backend.cluster.supervise",
               sys.executable, "-m", "spanq_integrations.cli", "serve", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), *args]  # fmt: skip
    with open(log, "wb") as out:
        supervisor = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        server = wait_for(
            "spanq serve started",
            lambda: next((p for p in processes(parent=supervisor.pid) if b"spanq_integrations.cli" in cmdline(p)), 0),
            60,
            log,
        )
    except BaseException:
        Supervised(supervisor, 0, "", log).kill_group()
        raise
    return Supervised(supervisor, server, f"http://127.0.0.1:{port}", log)


class Ahead:
    """A command run to its end in the background, at the lowest CPU priority (`in_background`), started before
    the test that reads it needs it (a module's `start_ahead`, called by tests/conftest.py once the session's tests
    are collected): its output goes to files, so nothing blocks on a pipe nobody reads yet. `result()` waits."""

    def __init__(
        self, command: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None,
        owns: Sequence[Path] = (),
    ):
        self.command = list(command)
        self.owns = list(owns)  # folders the command reads or writes, removed with it
        self.folder = Path(tempfile.mkdtemp(prefix="spanq-tests-ahead-"))
        with open(self.folder / "stdout", "wb") as out, open(self.folder / "stderr", "wb") as err:
            self.proc = subprocess.Popen(ending_with_the_tests(in_background(self.command)), stdout=out, stderr=err,
                                         cwd=cwd, env=dict(env) if env else None, start_new_session=True)  # fmt: skip

    def result(self, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """The finished run (a failure to finish in `timeout` seconds fails the test)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"{' '.join(self.command)[:200]} did not end within {timeout:.0f} s")
        out, err = ((self.folder / name).read_text(errors="replace") for name in ("stdout", "stderr"))
        return subprocess.CompletedProcess(self.command, self.proc.returncode, out, err)

    def stop(self) -> None:
        """End it if it still runs, and remove its files and the folders it owns."""
        if self.proc.poll() is None:
            stop(self.proc)
        for folder in (self.folder, *self.owns):
            shutil.rmtree(folder, ignore_errors=True)


class AheadOnce:
    """A test module's one `Ahead` run, read by its fixture `fixture`: `start_ahead(items)` starts it (`start()`)
    when a collected test needs that fixture, `result()` waits for it (starting it if nothing did), `stop_ahead()`
    ends it. A module hands tests/conftest.py its hooks: `start_ahead, stop_ahead = RUN.start_ahead, RUN.stop_ahead`."""

    def __init__(self, fixture: str, start: Callable[[], Ahead]):
        self.fixture, self.start = fixture, start
        self.running: Ahead | None = None

    def start_ahead(self, items: Sequence[Any]) -> None:
        if self.running is None and any(self.fixture in getattr(item, "fixturenames", ()) for item in items):
            self.running = self.start()

    def result(self) -> subprocess.CompletedProcess[str]:
        if self.running is None:
            self.running = self.start()
        return self.running.result()

    def stop_ahead(self) -> None:
        if self.running is not None:
            self.running.stop()
            self.running = None
