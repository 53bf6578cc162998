"""An embedded engine's end: closed while calls run, failed in its thread, failing to start, ending a request
with an error. Each on an engine of its own (the tiny model, a small KV cache), so that the session's engines
are not touched. Failures the engine cannot be made to have here (a step that raises, a grammar that does not
compile) are injected at the one vLLM call they stand for."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from spanq_integrations import BackendError, BackendUnavailableError, generate, user

pytestmark = pytest.mark.vllm


def _engine(tiny_model, **options):
    from spanq_backend.serving.embedded import EmbeddedBackend

    return EmbeddedBackend(str(tiny_model), kv_cache_gib=0.25, max_model_len=1024, max_num_seqs=4, **options)


async def test_calls_running_when_the_engine_is_closed_end_with_an_error_and_its_memory_goes(tiny_model):
    """A call streaming when the engine closes, and one queued behind it, end with `BackendUnavailableError`
    (they waited for ever), `settle` answers at once, later calls are refused, and the engine lets go of its
    weights and KV cache (an adapter may keep the backend object for the life of the process)."""
    backend = _engine(tiny_model)
    first_token = asyncio.Event()
    running = asyncio.create_task(backend.generate(generate(user("Count to a thousand."), max_tokens=900),
                                                   on_token=lambda piece: first_token.set()))  # fmt: skip
    await asyncio.wait_for(first_token.wait(), 30)
    queued = asyncio.create_task(backend.generate(generate(user("And again."), max_tokens=900)))
    await asyncio.sleep(0)
    await asyncio.to_thread(backend.close)
    for task in (running, queued):
        with pytest.raises(BackendUnavailableError, match="closed"):
            await asyncio.wait_for(task, 10)
    started = time.monotonic()
    assert backend.engine.settle(timeout=30) is False and time.monotonic() - started < 1
    with pytest.raises(BackendUnavailableError, match="closed"):
        await backend.generate(generate(user("hi"), max_tokens=2))
    assert backend.engine.llm_engine is None


async def test_when_the_engine_thread_fails_every_call_under_way_or_queued_ends_with_its_reason(tiny_model):
    backend = _engine(tiny_model)
    try:
        step = backend.engine.llm_engine.step

        def failing_step():
            time.sleep(0.5)  # the second call arrives meanwhile: queued, not yet in the engine
            step()
            raise RuntimeError("boom in step")

        backend.engine.llm_engine.step = failing_step
        first = asyncio.create_task(backend.generate(generate(user("hi"), max_tokens=50)))
        await asyncio.sleep(0.2)
        second = asyncio.create_task(backend.generate(generate(user("hello"), max_tokens=50)))
        for task in (first, second):
            with pytest.raises(BackendUnavailableError, match="boom in step"):
                await asyncio.wait_for(task, 15)
        with pytest.raises(BackendUnavailableError, match="boom in step"):
            await backend.generate(generate(user("later"), max_tokens=2))
    finally:
        backend.close()


async def _fail_in_step(backend):
    """Make `backend`'s engine fail in its next step (the one vLLM call a failure stands for) through a call, which
    ends with the failure; the failed engine."""
    failed = backend.engine
    step = failed.llm_engine.step

    def failing_step():
        step()
        raise RuntimeError("boom in step")

    failed.llm_engine.step = failing_step
    with pytest.raises(BackendUnavailableError, match="boom in step"):
        await backend.generate(generate(user("hi"), max_tokens=5))
    return failed


async def test_a_shared_engine_that_failed_is_started_again_by_the_next_call_and_a_shut_down_one_is_not(
    tiny_model, monkeypatch
):
    """The process-wide engine every adapter that names no backend holds: after its thread failed, every later
    call was refused for the life of the process (the adapters keep the backend object). The next call now starts
    it again, saying why; `shutdown()` still ends it for good."""
    import logging

    from spanq_backend.serving.embedded import shared_embedded_backend

    backend = shared_embedded_backend(str(tiny_model))
    try:
        failed = await _fail_in_step(backend)
        said: list[str] = []
        monkeypatch.setattr(logging.getLogger("spanq.embedded"), "warning", lambda msg, *a: said.append(msg % a))
        again = await asyncio.gather(*(backend.generate(generate(user("hi"), max_tokens=2)) for _ in range(2)))
        assert all(isinstance(c.text, str) for c in again)
        assert backend.engine is not failed and not backend.engine.closed
        assert shared_embedded_backend(str(tiny_model)) is backend
        assert len(said) == 1 and "boom in step" in said[0], said  # one restart for the two calls, saying why
    finally:
        backend.shutdown()
    with pytest.raises(BackendUnavailableError, match="closed"):
        await backend.generate(generate(user("hi"), max_tokens=2))


async def test_a_shared_engine_that_cannot_start_again_is_not_retried_by_every_call_nor_outlives_a_shutdown(
    tiny_model, monkeypatch
):
    """A start that fails (here: a tier path the OS refuses) is tried once for the calls waiting on it, not once
    each (seconds to minutes apiece on a GPU); and a `shutdown()` while a start is under way closes that engine
    when it is done: it ran on, in no registry, holding its memory, and the shut-down backend answered on it."""
    import dataclasses
    import logging
    import threading

    from spanq_backend.serving.embedded import shared_embedded_backend
    from spanq_backend.serving.engine import ENGINE_THREAD_NAME

    def engine_threads() -> int:
        return sum(t.name == ENGINE_THREAD_NAME and t.is_alive() for t in threading.enumerate())

    backend = shared_embedded_backend(str(tiny_model))
    try:
        failed = await _fail_in_step(backend)
        for _ in range(3000):  # its thread stopped and let go of vLLM's engine
            if failed.llm_engine is None:
                break
            await asyncio.sleep(0.01)
        baseline = engine_threads()
        said: list[str] = []
        monkeypatch.setattr(logging.getLogger("spanq.embedded"), "warning", lambda msg, *a: said.append(msg % a))
        config = failed.config
        failed.config = dataclasses.replace(config, tier_dir="/tmp/a\0b")  # its next start fails
        outcomes = await asyncio.gather(*(backend.generate(generate(user("hi"), max_tokens=2)) for _ in range(3)),
                                        return_exceptions=True)  # fmt: skip
        assert all(isinstance(o, BackendError) for o in outcomes), outcomes
        assert len(said) == 1, said  # one start tried for the three calls
        assert "null byte" in str(outcomes[1]) + str(outcomes[2])  # the others told why at once

        failed.config = config
        backend._failed_start = None  # as after the back-off
        call = asyncio.create_task(backend.generate(generate(user("hi"), max_tokens=2)))
        while not backend._restart_lock.locked():  # the start under way
            await asyncio.sleep(0.01)
        await asyncio.to_thread(backend.shutdown)
        with pytest.raises(BackendUnavailableError, match="closed|failed"):
            await asyncio.wait_for(call, 120)
        assert backend.engine is failed and engine_threads() == baseline  # the engine it started is closed
    finally:
        backend.shutdown()


def test_an_engine_that_cannot_start_for_any_reason_says_so_and_does_not_hang(tiny_model):
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            _engine(tiny_model, tier_dir="/tmp/a\0b").close()  # a path the OS refuses (ValueError)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - what the constructor raised
            outcome.append(e)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    starter.join(60)
    assert not starter.is_alive(), "the constructor still waits for an engine thread that died"
    assert isinstance(outcome[0], BackendError) and "null byte" in str(outcome[0])


async def test_a_request_the_engine_ends_with_an_error_is_an_error_not_an_empty_answer(tiny_model, monkeypatch):
    """vLLM ends a request with finish reason "error" when it cannot run it (here: a JSON schema whose grammar
    does not compile); that was returned as an empty answer, which the tool adapter then blamed on max_tokens."""
    from vllm.v1.structured_output import StructuredOutputManager

    def broken(self, request):
        raise RuntimeError("grammar compilation failed")

    monkeypatch.setattr(StructuredOutputManager, "_create_grammar", broken)
    backend = _engine(tiny_model, compact_json=True)
    try:
        with pytest.raises(BackendError, match='finish reason "error"'):
            await asyncio.wait_for(backend.generate(generate(user("Give JSON"), max_tokens=30,
                                                             json_schema='{"type": "object"}')), 60)  # fmt: skip
    finally:
        backend.close()


_OWN_ENGINE_SCRIPT = """
import atexit, sys
from spanq_integrations import cross, execute, fragment, generate, plus, system, user
from spanq_backend.serving import engine as engine_module
from spanq_backend.serving.embedded import EmbeddedBackend

if "--no-close-at-exit" in sys.argv:  # the broken implementation: engines left running at exit
    atexit.unregister(engine_module._close_running)
else:
    with EmbeddedBackend(sys.argv[1], kv_cache_gib=0.25) as first:  # closed as the block ends
        pass
    print("closed by with:", first.engine.closed, flush=True)
backend = EmbeddedBackend(sys.argv[1], kv_cache_gib=0.25)  # a script's own engine, never closed
docs = [f"Document {i} is about topic {i} and nothing else at all. " * 18 for i in range(6)]
query = generate(cross(system("Answer."), plus(*[fragment(d) for d in docs]), user("Which topic?")),
                 max_tokens=2, temperature=0)
print("deferred:", execute(query, backend).calls[0].deferred_spans, flush=True)
"""


def test_a_script_that_leaves_its_own_engine_running_ends_cleanly(tiny_model, tmp_path):
    """A script that builds its own `EmbeddedBackend` and ends right after its answer, while the engine computes
    the new documents' deferred prepares: the engine is stopped at exit, not torn down mid-step (which printed
    "the engine failed" and a traceback of vLLM's on every such run). An engine left running at exit, as before,
    does fail so. `with EmbeddedBackend(...)` closes the engine it started."""
    import os
    import subprocess
    import sys

    script = tmp_path / "own_engine.py"
    script.write_text(_OWN_ENGINE_SCRIPT)

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), str(tiny_model), *extra], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "SPANQ_DEBUG": ""}, check=False)  # fmt: skip

    done = run()
    assert done.returncode == 0, done.stderr[-2000:]
    assert "closed by with: True" in done.stdout and "deferred: 6" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr and "engine failed" not in done.stderr, done.stderr[-2000:]
    assert "terminate called" not in done.stderr, done.stderr[-2000:]

    broken = run("--no-close-at-exit")
    assert "deferred: 6" in broken.stdout, broken.stdout  # its answer came, with prepares still to run at exit
    # Torn down mid-step, it fails one of two ways by when exit finds the engine's thread: vLLM's traceback
    # ("the engine failed"), or the C++ runtime's abort of a thread still running ("terminate called …", seen in
    # a clean-clone CI run)
    torn = ("engine failed" in broken.stderr and "Traceback" in broken.stderr) or "terminate called" in broken.stderr
    assert torn, broken.stderr[-2000:]
