"""`ProcessBackend`: an embedded engine in a process of its own, so a benchmark's baseline is stock vLLM.

The process is started with multiprocessing's spawn (a fresh interpreter), and with `plugin=False` it runs with
`SPANQ_DISABLE_PLUGIN=1`: its engine is vLLM with none of spanq's hooks, not a span engine that merely receives
no span tables. Each `generate` is sent over a pipe and runs there, concurrently with the others; its metrics
(time to first token included) are measured there, as an in-process backend measures them, so the pipe's cost
is not in the numbers. Streaming (`on_token`) is not carried: benchmarks read the metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import pickle
import threading
from typing import Any

from spanq_integrations.backends.protocol import Backend, BackendCapabilities, Completion, TokenCallback
from spanq_integrations.query.errors import BackendError, BackendUnavailableError
from spanq_integrations.query.ir import Generate

__all__ = ["ProcessBackend"]

START_TIMEOUT_S = 600


def _portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else a `BackendError` that says what it was."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001  (any unpicklable error is reported by name)
        return BackendError(f"{type(e).__name__}: {e}")


def _child(conn: Any, model: str, spans: bool, plugin: bool, options: dict[str, Any]) -> None:
    """The engine's process: start the backend, then run every `generate` the pipe brings until told to stop.
    Ctrl-C is the benchmark's to handle (it reaches the whole process group): this process ignores it and ends when
    the parent says stop or goes (its pipe closes), instead of printing its own tracebacks."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not plugin:
        os.environ["SPANQ_DISABLE_PLUGIN"] = "1"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from spanq_backend import vllm_integration
        from spanq_backend.serving.embedded import EmbeddedBackend

        backend = EmbeddedBackend(model, spans=spans, **options)
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which raises it)
        conn.send(("failed", _portable(e)))
        return
    conn.send(("ready", backend.capabilities.model_dump(), bool(vllm_integration._registered)))

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        def read() -> None:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = ("stop",)
                try:
                    loop.call_soon_threadsafe(inbox.put_nowait, msg)
                except RuntimeError:  # the loop has ended (told to stop meanwhile): nothing is left to read for
                    return
                if msg[0] == "stop":
                    return

        threading.Thread(target=read, name="spanq-bench-pipe", daemon=True).start()
        running: set[asyncio.Task] = set()

        async def one(rid: int, call: Generate, path: str) -> None:
            try:
                completion = await backend.generate(call, path=path)
                conn.send(("ok", rid, completion))
            except Exception as e:  # noqa: BLE001  (every failure goes back to its caller)
                conn.send(("error", rid, _portable(e)))

        async def on_engine(rid: int, name: str, args: tuple) -> None:
            from benchmarks import engine_scoring

            try:
                conn.send(("ok", rid, await getattr(engine_scoring, name)(backend.engine, *args)))
            except Exception as e:  # noqa: BLE001  (every failure goes back to its caller)
                conn.send(("error", rid, _portable(e)))

        while True:
            msg = await inbox.get()
            if msg[0] == "stop":
                break
            if msg[0] == "reset":  # between measurements: forget every cached block
                conn.send(("ok", msg[1], backend.engine.reset_prefix_cache()))
                continue
            if msg[0] == "engine":  # a function of `engine_scoring` on the engine itself
                task = asyncio.ensure_future(on_engine(*msg[1:]))
                running.add(task)
                task.add_done_callback(running.discard)
                continue
            task = asyncio.ensure_future(one(*msg[1:]))
            running.add(task)
            task.add_done_callback(running.discard)
        for task in running:
            task.cancel()

    try:
        asyncio.run(serve())
    finally:
        backend.close()


class ProcessBackend(Backend):
    """An `EmbeddedBackend` on `model` in a spawned process; `plugin=False`: that process has no spanq plugin."""

    def __init__(self, model: str, *, spans: bool = False, plugin: bool = False, **engine_options: Any):
        if spans and not plugin:
            raise ValueError("a span engine needs the plugin")
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child, args=(child, model, spans, plugin, engine_options), name="spanq-bench-engine", daemon=True
        )
        self._proc.start()
        child.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self._proc.kill()
            raise BackendUnavailableError(f"the engine process for {model} did not start in {START_TIMEOUT_S} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise BackendUnavailableError(
                f"the engine process for {model} exited during start-up (exit code {self._proc.exitcode})"
            ) from None
        if msg[0] == "failed":
            self._proc.join(30)
            raise msg[1]
        _, capabilities, registered = msg
        if registered != plugin:
            self.close()
            raise BackendError(f"the engine process has the plugin {'on' if registered else 'off'}, not as asked")
        self.plugin = registered
        self.capabilities = BackendCapabilities(**capabilities)
        self._ids = itertools.count()
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._send_lock = threading.Lock()
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="spanq-bench-results", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                kind, rid, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            loop, fut = self._pending.pop(rid, (None, None))
            if loop is not None:
                _deliver(loop, fut, kind, payload)
        gone = BackendUnavailableError("the engine process is gone")
        for loop, fut in list(self._pending.values()):
            _deliver(loop, fut, "error", gone)
        self._pending.clear()

    async def generate(
        self, call: Generate, *, path: str = "$", on_token: TokenCallback | None = None, **_: Any
    ) -> Completion:
        return await self._request(("generate", call, path))

    async def areset_prefix_cache(self) -> bool:
        """Forget every block the engine has cached (False while requests run there)."""
        return bool(await self._request(("reset",)))

    async def on_engine(self, name: str, *args: Any) -> Any:
        """`benchmarks.engine_scoring.<name>(engine, *args)` run on the engine in that process (plain data)."""
        return await self._request(("engine", name, args))

    async def _request(self, msg: tuple) -> Any:
        if self._closed or not self._proc.is_alive():
            raise BackendUnavailableError("the engine process is closed")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        rid = next(self._ids)
        self._pending[rid] = (loop, fut)
        with self._send_lock:
            self._conn.send((msg[0], rid, *msg[1:]))
        return await fut

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with self._send_lock:
                self._conn.send(("stop",))
        except (OSError, ValueError):
            pass
        self._proc.join(60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._conn.close()

    async def aclose(self) -> None:
        self.close()


def _deliver(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, kind: str, payload: Any) -> None:
    """Settle `fut` on its loop; a loop that is gone (its caller gave up) is skipped, not fatal to the reader."""
    try:
        loop.call_soon_threadsafe(_settle, fut, kind, payload)
    except RuntimeError:
        pass


def _settle(fut: asyncio.Future, kind: str, payload: Any) -> None:
    if fut.done():
        return
    if kind == "ok":
        fut.set_result(payload)
    else:
        fut.set_exception(payload)
