"""Starting and stopping real servers for tests: a free loopback port, a process group, a readiness wait."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

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
                in_background(self.command) if ahead else self.command, stdout=out, stderr=subprocess.STDOUT,
                env=dict(env) if env else None, start_new_session=True,
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
