"""Fixtures of the client-side tests: a stock vLLM OpenAI-compatible server on the tiny model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

SERVER_START_TIMEOUT_S = 420  # a loaded 2-core machine can take minutes
SERVED_MODEL_NAME = "tiny"


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _models_answer(url: str) -> list[str] | None:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as response:
            return [m["id"] for m in json.load(response)["data"]]
    except (OSError, urllib.error.URLError, ValueError, KeyError):
        return None


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server and everything it started (it runs in its own process group)."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="session")
def stock_vllm_server(tiny_model, tmp_path_factory) -> Iterator[str]:
    """The base URL (no /v1) of an unmodified `vllm` OpenAI-compatible server serving the tiny model as "tiny".

    Prefix caching is on and usage reports cached tokens (`--enable-prompt-tokens-details`). Plugins are off
    (`VLLM_PLUGINS=`), so even with spanq installed this is the stock server.
    """
    pytest.importorskip("vllm")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("stock-vllm") / "server.log"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        "4096",
        "--enforce-eager",  # no torch.compile warm-up: the server starts in seconds instead of a minute
    ]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_PLUGINS": "",
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server keeps vLLM's default engine mode
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while _models_answer(url) is None:
            if proc.poll() is not None:
                pytest.fail(f"the stock vLLM server exited with {proc.returncode}:\n{_log_tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the stock vLLM server did not answer within {SERVER_START_TIMEOUT_S} s:\n{_log_tail(log_path)}"
                )
            time.sleep(1)
        yield url
    finally:
        _stop(proc)
