"""SpanEngine: vLLM's engine in this process, driven from its own thread, with span-aware generation on top.

One thread owns the `LLMEngine` and steps it; callers on any event loop (or several) submit requests and
receive outputs through thread-safe queues. `generate()` lowers a closed `Generate` to tokens and a span
table, prepares the spans that are not cached yet (one `[anchor][span]` request each, all at once), then runs
the request itself with the span table attached out of band: that part is `SpanGenerator`
(`span_generation`), shared with `spanq serve`; this module only drives the engine.

Until concurrent repositioning (CIDRA) lands, the engine never runs two requests that need the same span at
different positions at the same time: the engine thread starts a request only when its span claims do not
conflict with running ones (`SpanClaims`), and holds it back until they finish.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from spanq_integrations.backends.base import Completion, TokenCallback
from spanq_integrations.errors import BackendError, BackendUnavailableError
from spanq_integrations.ir import Generate

from .cache_probe import BlockPoolProbe
from .lowering import LoweredPrompt
from .span_generation import SpanClaims, SpanGenerator, engine_error, load_chat_tokenizer
from .span_table import SpanTable
from .vllm_plugin import SpanSupport, query_span_support

__all__ = ["EngineConfig", "SpanEngine"]

log = logging.getLogger("spanq.engine")


@dataclass(frozen=True)
class EngineConfig:
    """How the embedded engine is built. The defaults suit the CPU machines spanq is developed on."""

    model: str = "default"
    block_size: int = 32
    max_model_len: int | None = 4096
    kv_cache_gib: float = 1.0
    dtype: str = "float32"
    spans: bool = True  # False: a stock engine (prefix caching only), for side-by-side measurements
    max_num_seqs: int = 16
    default_max_tokens: int = 256
    seed: int = 0
    served_model_name: str | None = None
    enforce_eager: bool = True  # no torch.compile warm-up: starts in seconds instead of about a minute here
    num_blocks: int | None = None  # KV blocks (vLLM's num_gpu_blocks_override); None: from kv_cache_gib


def _cpu_env_defaults(kv_cache_gib: float) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, (os.cpu_count() or 1) - 1)}")


@dataclass
class _Request:
    rid: str
    prompt_ids: list[int]
    params: Any
    claims: dict[str, int]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue


# In-process vLLM engines share the process's distributed state (vLLM's parallel groups). Shutting one engine
# down tears that state down, which would break every other engine still running in the process, so an engine
# that is not the last one shuts down without it.
_live_lock = threading.Lock()
_live_engines = 0


def _retire(engine: Any) -> None:
    """Shut a stopped engine down now (not at garbage collection), sparing the shared state unless it is last."""
    from vllm.v1.engine import core

    global _live_engines
    with _live_lock:
        _live_engines -= 1
        stock_cleanup = core.cleanup_dist_env_and_memory
        if _live_engines > 0:
            core.cleanup_dist_env_and_memory = lambda *args, **kwargs: gc.collect()
        try:
            engine.engine_core.shutdown()
        except Exception:  # a failed engine may not shut down cleanly; it is gone either way
            log.exception("shutting the engine down failed")
        finally:
            core.cleanup_dist_env_and_memory = stock_cleanup


class SpanEngine:
    """An in-process vLLM engine with span-aware generation. Thread-safe; usable from any event loop."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        self.config = config or EngineConfig(**overrides)
        if config is not None and overrides:
            self.config = EngineConfig(**{**config.__dict__, **overrides})
        from .models import resolve_model

        self.model_path: Path = resolve_model(self.config.model)
        self.model_name = self.config.served_model_name or self.model_path.name
        if self.config.spans:
            from .kv_layout import check_relocatable
            from .rerope import RelocationError

            try:
                check_relocatable(self.model_path)
            except RelocationError as e:
                raise BackendError(f"spans are refused for this model: {e}") from e
        _cpu_env_defaults(self.config.kv_cache_gib)

        self.tokenizer = load_chat_tokenizer(self.model_path)
        self._ids = itertools.count()
        self._cmds: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._closed = False
        self._active: dict[str, _Request] = {}
        self._pending: list[_Request] = []
        self._claims = SpanClaims()  # touched by the engine thread only
        self._thread = threading.Thread(target=self._run, name="spanq-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise BackendError(f"could not start vLLM on {self.model_path}: {self._start_error}") from self._start_error
        self.generator = SpanGenerator(
            self._stream,
            self.tokenizer,
            block_size=self.config.block_size,
            max_model_len=self.max_model_len,
            model_name=self.model_name,
            default_max_tokens=self.config.default_max_tokens,
            spans=self.config.spans and self.span_support.enabled,
            span_cached=self._probe.cached if self._probe is not None else None,
            fallback=self.span_support.reason if self.config.spans and not self.span_support.enabled else None,
        )
        self.pad_token_id = self.generator.pad_token_id

    # ----------------------------------------------------------------------------------------- engine thread

    def _build(self) -> Any:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        c = self.config
        args = EngineArgs(
            model=str(self.model_path),
            served_model_name=self.model_name,
            dtype=c.dtype,
            block_size=c.block_size,
            enable_prefix_caching=True,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            seed=c.seed,
            enforce_eager=c.enforce_eager,
            num_gpu_blocks_override=c.num_blocks,
        )
        engine = self.llm_engine = LLMEngine.from_engine_args(args)  # stepped by the engine thread only
        self.max_model_len = engine.model_config.max_model_len
        self.span_support = SpanSupport(False, "a stock engine (spans=False)")
        if c.spans:
            # The engine core asked its workers the same at start-up and ignores span tables unless all move
            # keys; this engine then lays prompts out as stock and says why on every call.
            self.span_support = query_span_support(engine.collective_rpc)
            if not self.span_support.enabled:
                log.warning("spans are off for %s: %s", self.model_path.name, self.span_support.reason)
        self._probe = BlockPoolProbe.of(engine, c.block_size) if self.span_support.enabled else None
        return engine

    def _run(self) -> None:
        try:
            with _live_lock:
                global _live_engines
                _live_engines += 1
            engine = self._build()
        except BaseException as e:  # noqa: BLE001  (reported to the constructor's caller)
            with _live_lock:
                _live_engines -= 1
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                busy = engine.has_unfinished_requests()
                try:
                    cmd = self._cmds.get(block=not busy)
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if cmd[0] == "stop":
                        return
                    self._handle(engine, cmd)
                    try:
                        cmd = self._cmds.get_nowait()
                    except queue.Empty:
                        cmd = None
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        self._deliver(engine, out)
        except BaseException as e:
            log.exception("the engine failed")
            self._closed = True
            for req in list(self._active.values()) + self._pending:
                self._send(req, BackendUnavailableError(f"the embedded engine failed: {e}"))
        finally:
            try:
                _retire(engine)
                del engine
            except UnboundLocalError:
                pass

    def _handle(self, engine: Any, cmd: tuple) -> None:
        kind, req = cmd
        if kind == "add":
            if self._conflicts(req):
                self._pending.append(req)
            else:
                self._start(engine, req)
        elif kind == "abort":
            if req.rid in self._active:
                engine.abort_request([req.rid])
                self._finish(engine, req)
            elif req in self._pending:
                self._pending.remove(req)

    def _conflicts(self, req: _Request) -> bool:
        return self._claims.conflicts(req.claims)

    def _start(self, engine: Any, req: _Request) -> None:
        from vllm.inputs import TokensPrompt

        try:
            engine.add_request(req.rid, TokensPrompt(prompt_token_ids=req.prompt_ids), req.params)
        except Exception as e:  # noqa: BLE001  (any refusal goes back to the request's caller)
            self._send(req, engine_error(e))
            return
        self._active[req.rid] = req
        self._claims.take(req.claims)

    def _finish(self, engine: Any, req: _Request) -> None:
        self._active.pop(req.rid, None)
        self._claims.release(req.claims)
        waiting, self._pending = self._pending, []
        for w in waiting:
            if self._conflicts(w):
                self._pending.append(w)
            else:
                self._start(engine, w)

    def _deliver(self, engine: Any, out: Any) -> None:
        req = self._active.get(out.request_id)
        if req is None:
            return
        self._send(req, out)
        if out.finished:
            self._finish(engine, req)

    def _send(self, req: _Request, item: Any) -> None:
        try:
            req.loop.call_soon_threadsafe(req.out.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone; nobody is waiting
            pass

    # ----------------------------------------------------------------------------------------- callers

    def _submit(self, prompt_ids: list[int], params: Any, claims: dict[str, int]) -> _Request:
        if self._closed:
            raise BackendUnavailableError("the embedded engine is closed")
        loop = asyncio.get_running_loop()
        req = _Request(f"spanq-{next(self._ids)}", prompt_ids, params, claims, loop, asyncio.Queue())
        self._cmds.put(("add", req))
        return req

    async def _outputs(self, req: _Request):
        """Yield the request's outputs; abort it in the engine if the caller stops early or is cancelled."""
        finished = False
        try:
            while True:
                item = await req.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._cmds.put(("abort", req))

    def _stream(self, prompt_ids: list[int], params: Any, claims: Any) -> AsyncIterator[Any]:
        """`SpanGenerator`'s way onto this engine: submit to the engine thread (which honours the claims)."""
        return self._outputs(self._submit(prompt_ids, params, dict(claims)))

    async def run_tokens(
        self, prompt_ids: list[int], params: Any, claims: dict[str, int] | None = None,
        table: SpanTable | None = None, on_text: TokenCallback | None = None,
    ) -> tuple[list[Any], float | None]:
        """Run one request to the end; returns its outputs (deltas) and the time its first text arrived."""
        run = await self.generator.run(prompt_ids, params, claims, table, on_text)
        return run.outputs, run.first_text_at

    def lower(self, call: Generate) -> LoweredPrompt:
        return self.generator.lower(call)

    async def prepare(self, lowered: LoweredPrompt) -> int:
        """Put every span's isolated KV in the cache (one `[anchor][span]` request each, run together).

        Returns how many spans had to be computed (the others were already cached)."""
        return await self.generator.prepare(lowered)

    async def generate(self, call: Generate, *, path: str = "$", on_token: TokenCallback | None = None) -> Completion:
        """Run one closed `Generate`: lower, prepare spans, run; with TTFT and cache usage measured."""
        return await self.generator.generate(call, path=path, on_token=on_token)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._cmds.put(("stop", None))
            self._thread.join(timeout=30)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

