"""SpanEngine: vLLM's engine in this process, driven from its own thread, with span-aware generation on top.

One thread owns the `LLMEngine` and steps it; callers on any event loop (or several) submit requests and
receive outputs through thread-safe queues. `generate()` lowers a closed `Generate` to tokens and a span
table, prepares the spans that are not cached yet (one `[anchor][span]` request each, all at once), then runs
the request itself with the span table attached out of band: that part is `SpanGenerator` (`generator`),
shared with `spanq serve`; this module only drives the engine.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from spanq_backend.kv.span_table import SpanTable
from spanq_backend.serving.engine_defaults import ENGINE_DEFAULTS, cpu_env_defaults, platform_defaults
from spanq_backend.serving.generator import (
    IDLE_BATCH_TOKENS,
    ISOLATE_MIN_TOKENS,
    LEAD_IN_NEUTRAL,
    SpanGenerator,
    between_parts,
    budget_after,
    engine_error,
    idle_part,
    load_chat_tokenizer,
    settle_deferred,
)
from spanq_backend.serving.lowering import DEFAULT_ANCHOR, LoweredPrompt
from spanq_backend.serving.recompute import DEFAULT_RECOMPUTE, recompute_setting
from spanq_backend.vllm_integration import openmp, tier
from spanq_backend.vllm_integration.cache_probe import BlockPoolProbe
from spanq_backend.vllm_integration.engine_core import engine_pins
from spanq_backend.vllm_integration.frontend import in_process_engines
from spanq_backend.vllm_integration.support import STOCK, STOCK_ENGINE_KEY, query_span_support
from spanq_integrations.backends.protocol import Completion, TokenCallback
from spanq_integrations.query.errors import BackendError, BackendUnavailableError
from spanq_integrations.query.ir import COLD_SPAN_POLICIES, AnchorPolicy, Generate, Recompute

__all__ = ["EngineConfig", "SpanEngine"]

log = logging.getLogger("spanq.engine")

# Engines started in this process and not yet closed: stopped at exit (`_close_running`).
_running: weakref.WeakSet[SpanEngine] = weakref.WeakSet()


@atexit.register
def _close_running() -> None:
    """At exit, stop every engine still running. Its thread is a daemon: one still computing deferred prepares when
    a script ended (a script's own `EmbeddedBackend("tiny")` after its answer) ran its step while the interpreter
    tore the model down, and printed "the engine failed" with a traceback of vLLM's."""
    for engine in list(_running):
        try:
            engine.close()
        except Exception:  # at exit: nothing left to tell
            log.debug("closing an engine at exit", exc_info=True)


# Constrained decoding for tool calls and structured output is vLLM's (xgrammar; objects closed to the properties
# their schema names unless it says `additionalProperties`, as OpenAI's strict mode reads a schema), with whitespace
# left to the model: SmolLM2 writes better JSON in the layout it learned (measured on the standard tests: 21 of 22
# pass with free whitespace, its strings loop under llguidance's). `compact_json` forbids whitespace, for models
# that pad JSON with it until max_tokens (random ones do).
COMPACT_JSON: dict[str, Any] = {"backend": "xgrammar", "disable_any_whitespace": True}


@dataclass(frozen=True)
class EngineConfig:
    """How the embedded engine is built. `dtype`, `enforce_eager` and the KV cache's size default by platform
    (`serving/engine_defaults.py`, the table `spanq serve` reads too): float32, eager and 1 GiB on a CPU; vLLM's
    own choices on a GPU."""

    model: str = ENGINE_DEFAULTS["model"]
    block_size: int = ENGINE_DEFAULTS["block_size"]
    max_model_len: int | None = ENGINE_DEFAULTS["max_model_len"]
    # The KV cache's size, this engine's own (several engines in one process may differ). None: on a CPU,
    # vLLM's VLLM_CPU_KVCACHE_SPACE where the user set it, else DEFAULT_KV_CACHE_GIB; on a GPU, vLLM's
    # gpu_memory_utilization.
    kv_cache_gib: float | None = None
    dtype: str | None = None  # None: float32 on a CPU, the model's own ("auto") elsewhere
    spans: bool = True  # False: a stock engine (prefix caching only), for side-by-side measurements
    max_num_seqs: int = 16
    default_max_tokens: int = 256
    seed: int = 0
    served_model_name: str | None = None
    enforce_eager: bool | None = None  # None: on a CPU no torch.compile warm-up (seconds, not a minute); vLLM's elsewhere
    num_blocks: int | None = None  # KV blocks (vLLM's num_gpu_blocks_override); None: from kv_cache_gib
    span_anchor: AnchorPolicy = DEFAULT_ANCHOR  # the anchor policy of a `plus` that names none
    span_lead_in: str = LEAD_IN_NEUTRAL  # what a canonical anchor reads before each span: "neutral", "auto", a text, "none"
    cold_spans: str = "auto"  # spans not cached: "auto", "isolate" or "context" (`SpanGenerator.cold_policy`)
    # "auto": cold span tokens from which they are isolated (a call that recomputes blocks: at least
    # ISOLATE_MIN_TOKENS_RECOMPUTING, `SpanGenerator.isolate_from`)
    isolate_min_tokens: int = ISOLATE_MIN_TOKENS
    # A warm call whose documents the cache holds in context (read so before, in some order) is read as stock reads
    # it where that computes at most a block more than the span layout (`SpanGenerator.in_context`); False: spans
    read_in_context: bool = True
    # Read as spans, a group's documents go in one order per set (`lowering.span_order`: by a digest of their text, the
    # shortest last partial block last: nothing relocated when the set comes back, fewer tokens computed); True keeps
    # the order given (closer to a stock answer in that order, docs/benchmarks.md)
    keep_span_order: bool = False
    compact_json: bool = False  # JSON answers without whitespace (for models that pad them with it)
    recompute: Recompute = DEFAULT_RECOMPUTE  # span blocks recomputed in context when a call says nothing (docs/design.md)
    # A folder where span KV outlives the engine (`spanq_backend/vllm_integration/tier.py`): prepared spans are saved there and
    # loaded instead of computed, by this engine and by the next one started on it. None: no tier.
    tier_dir: str | None = None
    # The tier's capacity in bytes: past it the least recently used unpinned blocks are removed. None: no limit.
    tier_max_bytes: int | None = None
    # Pin every block this engine saves to the tier, and the blocks `compile` finds there (`spanq prepare --pin`).
    tier_pin: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", recompute_setting(self.recompute))  # refused here, before any engine
        if self.cold_spans not in COLD_SPAN_POLICIES:
            raise ValueError(f"cold_spans must be one of {', '.join(COLD_SPAN_POLICIES)}, got {self.cold_spans!r}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be a positive number of GiB, got {self.kv_cache_gib!r}")
        if self.tier_max_bytes is not None and not self.tier_max_bytes > 0:
            raise ValueError(f"tier_max_bytes must be a positive number of bytes, got {self.tier_max_bytes!r}")
        if (self.tier_max_bytes is not None or self.tier_pin) and not self.tier_dir:
            raise ValueError("tier_max_bytes and tier_pin are settings of a span tier: give tier_dir too")

    def kv_cache_bytes(self, cpu: bool | None = None) -> int | None:
        """The KV cache size this engine asks vLLM for; None: vLLM's own setting (VLLM_CPU_KVCACHE_SPACE on a
        CPU, gpu_memory_utilization elsewhere)."""
        if self.kv_cache_gib is not None:
            return int(self.kv_cache_gib * (1 << 30))
        if os.environ.get(KV_CACHE_ENV):
            return None
        return platform_defaults(cpu).get("kv_cache_memory_bytes")

    def engine_options(self, cpu: bool | None = None) -> dict[str, Any]:
        """dtype, enforce_eager and kv_cache_memory_bytes as vLLM gets them on this platform (`cpu`; None: here)."""
        table = platform_defaults(cpu)
        return {
            "dtype": self.dtype if self.dtype is not None else table.get("dtype", "auto"),
            "enforce_eager": self.enforce_eager if self.enforce_eager is not None else table.get("enforce_eager", False),
            "kv_cache_memory_bytes": self.kv_cache_bytes(cpu),
        }


KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's CPU platform reads it at every engine's config and lets it win

_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _kv_cache_size_of_its_own(config: EngineConfig) -> Iterator[None]:
    """While an engine with its own KV cache size is configured: vLLM's CPU platform would replace that size by
    VLLM_CPU_KVCACHE_SPACE (whole GiB, the same for every engine of the process); it does not see it then."""
    with _ENV_LOCK:
        hidden = os.environ.pop(KV_CACHE_ENV, None) if config.kv_cache_gib is not None else None
        try:
            yield
        finally:
            if hidden is not None:
                os.environ[KV_CACHE_ENV] = hidden


# In-process engines of one process step one at a time: two forward passes at once on the CPU backend (one
# oneDNN/OpenMP runtime per process) abort the process, and they would share the same cores anyway. An engine that
# works on its own (deferred prepares while idle) may otherwise step beside another engine's call.
_STEP_LOCK = threading.Lock()

ENGINE_THREAD_NAME = "spanq-engine"  # the thread that steps an engine, and (in the OS) its OpenMP workers

BATCH_WAIT_S = 5.0  # the most the engine thread waits for the rest of a batch (its caller submits in a loop)


@dataclass
class _Request:
    rid: str
    prompt_ids: list[int]
    params: Any
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    added_at_step: int = -1  # the engine's step count when it was added (its first step is the next)
    first_output_step: int = -1  # the step that produced its first output


class _Outputs:
    """A submitted request's outputs (deltas), in order; closing it before the end aborts the request in the
    engine (also when it was never read: a request submitted in a batch whose other reader failed)."""

    def __init__(self, engine: SpanEngine, req: _Request):
        self.engine = engine
        self.req = req
        self.done = False

    def __aiter__(self) -> _Outputs:
        return self

    async def __anext__(self) -> Any:
        if self.done:
            raise StopAsyncIteration
        item = await self.req.out.get()
        if isinstance(item, BaseException):
            self.done = True  # refused or failed in the engine: nothing left to abort
            raise item
        if item.finished:
            self.done = True
        return item

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.engine._cmds.put(("abort", self.req))


class SpanEngine:
    """An in-process vLLM engine with span-aware generation. Thread-safe; usable from any event loop."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        self.config = config or EngineConfig(**overrides)
        if config is not None and overrides:
            self.config = EngineConfig(**{**config.__dict__, **overrides})
        from spanq_backend.kv.rerope import RelocationError
        from spanq_backend.serving import logs
        from spanq_backend.serving.admission import admit
        from spanq_backend.serving.families import UnsupportedModelError, family_line

        try:
            logs.level()  # an unknown SPANQ_LOG_LEVEL is named before anything is loaded
        except ValueError as e:
            raise BackendError(str(e)) from None
        try:
            self.admitted = admit(self.config.model, spans=self.config.spans)  # as `spanq serve` admits it
        except UnsupportedModelError as e:
            raise BackendError(str(e)) from None
        except RelocationError as e:
            raise BackendError(f"spans are refused for this model: {e}") from e
        self.model_path: Path = self.admitted.path
        self.model_name = self.config.served_model_name or self.model_path.name
        cpu_env_defaults()
        logs.configure()  # (the level was checked above)
        if self.config.spans:
            log.info("%s", family_line(self.model_path))  # after logs.configure: shown on a quiet first run
        kind = "span-aware" if self.config.spans else "stock"
        log.info("starting a %s vLLM engine on %s …", kind, self.model_name)
        started = time.perf_counter()

        self.tokenizer = load_chat_tokenizer(self.model_path)
        self._ids = itertools.count()
        self._cmds: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._closed = False
        self._submit_lock = threading.Lock()  # `_put` and the thread's stopping: nothing queued unanswered
        self._failure: str | None = None  # why the engine thread stopped, where it failed
        self.tier: tier.DiskTier | None = None  # set when the engine is built with `tier_dir`
        self._active: dict[str, _Request] = {}
        self.steps = 0  # engine steps taken (each one forward pass over the scheduled batch)
        # Prompts to compute when the engine has nothing else to do (deferred span prepares), and those running.
        self._idle: collections.deque[tuple[list[int], concurrent.futures.Future[int]]] = collections.deque()
        # request id -> (prompt tokens less the pad token, the future its computed tokens go to)
        self._idle_running: dict[str, tuple[int, concurrent.futures.Future[int], bool]] = {}  # (length, future, last)
        # a prompt computed in parts: the tokens its parts computed so far, and where the last part ended
        self._idle_parts: dict[concurrent.futures.Future[int], tuple[int, int]] = {}
        self._settle_waiters: list[concurrent.futures.Future[bool]] = []
        # The last requests added, with the steps they were added at and first answered in (what a test or a
        # profile reads to see how many rounds a call took).
        self.recent: collections.deque[_Request] = collections.deque(maxlen=256)
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD_NAME, daemon=True)
        self._thread.start()
        _running.add(self)
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
            span_probe=self._probe,
            attention_scores=self._attention_scores,
            fallback=self.span_support.reason if self.config.spans and not self.span_support.enabled else None,
            default_anchor=self.config.span_anchor,
            default_recompute=self.config.recompute,
            batch=self.batch,
            default_lead_in=self.config.span_lead_in,
            cold_spans=self.config.cold_spans,
            isolate_min_tokens=self.config.isolate_min_tokens,
            background=self.run_when_idle,
            read_in_context=self.config.read_in_context,
            keep_span_order=self.config.keep_span_order,
        )
        self.generator.on_quiet = self._nudge
        self.pad_token_id = self.generator.pad_token_id
        log.info("%s ready in %.1f s", self.model_name, time.perf_counter() - started)

    # ----------------------------------------------------------------------------------------- engine thread

    def _build(self) -> Any:
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        from spanq_backend.serving import logs

        c = self.config
        args = EngineArgs(
            model=str(self.model_path),
            served_model_name=self.model_name,
            block_size=c.block_size,
            enable_prefix_caching=True,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            seed=c.seed,
            num_gpu_blocks_override=c.num_blocks,
            use_tqdm_on_load=logs.shows_progress(),  # quiet by default (spanq_backend/serving/logs.py)
            **c.engine_options(),  # dtype, enforce_eager, the KV cache's size: by platform
            # Sliding-window layers in the same KV cache group as the others: the group spans are moved in.
            disable_hybrid_kv_cache_manager=self.admitted.disable_hybrid_kv_cache_manager,
            # a stock engine says so to the engine core: no workers' self-check, no span table honoured
            **({} if c.spans else {"additional_config": {STOCK_ENGINE_KEY: True}}),
            **({"structured_outputs_config": StructuredOutputsConfig(**COMPACT_JSON)} if c.compact_json else {}),
            **({"kv_transfer_config": tier.transfer_config(c.tier_dir, c.tier_max_bytes, c.tier_pin)}
               if c.tier_dir else {}),
        )
        with _kv_cache_size_of_its_own(c):
            engine = self.llm_engine = LLMEngine.from_engine_args(args)  # stepped by the engine thread only
        self.max_model_len = engine.model_config.max_model_len
        self.span_support = STOCK
        if c.spans:
            # The engine core asked its workers the same at start-up and ignores span tables unless all move
            # keys; this engine then lays prompts out as stock and says why on every call.
            self.span_support = query_span_support(engine.collective_rpc)
            if not self.span_support.enabled:
                log.warning("spans are off for %s: %s", self.model_path.name, self.span_support.reason)
        self._probe = BlockPoolProbe.of(engine, c.block_size) if self.span_support.enabled else None
        # (`compile(pin=True)`: the engine core's pins, which `spanq serve` takes through a utility call)
        self._pins = engine_pins(engine.engine_core.engine_core) if self._probe is not None else None
        self.tier = tier.tier_for(c.tier_dir, engine.vllm_config) if c.tier_dir else None
        if self._probe is not None:
            self._probe.tier = self.tier
        return engine

    def _run(self) -> None:
        openmp.name_this_thread(ENGINE_THREAD_NAME)  # its OpenMP workers take the name too
        has_tier = bool(self.config.tier_dir)
        try:
            if has_tier:
                if not self.config.spans:
                    raise tier.TierError("a span tier holds span KV: a stock engine (spans=False) takes none")
                tier.check_tier_dir(self.config.tier_dir)
            in_process_engines.starting(tier=has_tier)
        except BaseException as e:  # noqa: BLE001 - a tier refused, another engine in the way, a bad path: the
            # constructor waits on `_ready` and raises it
            self._start_error = e
            self._ready.set()
            return
        try:
            engine = self._build()
        except BaseException as e:  # noqa: BLE001  (reported to the constructor's caller)
            in_process_engines.failed_to_start(tier=has_tier)
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        held = 0  # inside a batch (`batch`): everything up to its release is added before the next step
        stepped = True  # a step (or the build) ran since this thread last handed its OpenMP workers back
        try:
            while True:
                busy = engine.has_unfinished_requests() or (bool(self._idle) and not self._calls_running())
                if not busy and stepped:
                    # Idle: end this thread's OpenMP team, whose sleeping workers would otherwise throttle the
                    # spinning of every other busy team in the process (vllm_integration/openmp.py).
                    openmp.release_workers()
                    stepped = False
                try:
                    cmd = self._cmds.get(block=not busy)
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if cmd[0] == "stop":
                        return
                    if cmd[0] == "hold":
                        held += 1
                    elif cmd[0] == "release":
                        held = max(0, held - 1)
                    else:
                        self._handle(engine, cmd)
                    try:
                        cmd = self._cmds.get(timeout=BATCH_WAIT_S) if held > 0 else self._cmds.get_nowait()
                    except queue.Empty:
                        cmd = None
                if not engine.has_unfinished_requests() and self._idle and not self._calls_running():
                    self._start_idle(engine)
                self._answer_settled()
                if engine.has_unfinished_requests():
                    self.steps += 1
                    with _STEP_LOCK:  # one forward pass at a time in this process
                        outputs = engine.step()
                    stepped = True
                    for out in outputs:
                        self._deliver(engine, out)
                    self._answer_settled()  # the step may have finished the last deferred prepare
        except BaseException as e:
            log.exception("the engine failed")
            self._failure = f"the embedded engine failed: {e}"
        finally:
            # Whatever is under way or queued ends now, with an error saying why: a call running when the engine
            # is closed (or fails), or queued behind that, would otherwise wait for ever.
            with self._submit_lock:
                self._closed = True
            why = self._failure or "the embedded engine was closed"
            for req in list(self._active.values()):
                self._send(req, BackendUnavailableError(why))
            self._active.clear()
            self._drain_commands(why)
            for done in [*(d for _, d in self._idle), *(d for _, d, _ in self._idle_running.values())]:
                settle_deferred(done, "the engine closed")
            self._idle.clear()
            self._idle_running.clear()
            self._idle_parts.clear()
            for waiter in self._settle_waiters:
                if not waiter.done():
                    waiter.set_result(False)
            try:
                in_process_engines.retire(engine, tier=has_tier)
                del engine
            except UnboundLocalError:
                pass
            self.llm_engine = None  # its weights and KV cache go with it (an adapter may keep this object)

    def _drain_commands(self, why: str) -> None:
        """Answer every command still queued once the engine's thread has stopped taking them."""
        while True:
            try:
                kind, item = self._cmds.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._send(item, BackendUnavailableError(why))
            elif kind == "reset" and not item.done():
                item.set_exception(BackendUnavailableError(why))
            elif kind == "settle" and not item.done():
                item.set_result(False)
            elif kind == "idle":
                for _, done in item:
                    settle_deferred(done, why)

    def _calls_running(self) -> int:
        """Calls of this engine's generator under way (`SpanGenerator.calls_running`): deferred prepares wait for
        none, so that none shares a step with a call, between a call's rounds included."""
        gen = getattr(self, "generator", None)
        return gen.calls_running() if gen is not None else 0

    def _nudge(self) -> None:
        """Wake the engine's thread (no call runs now: its deferred prepares may start)."""
        self._cmds.put(("wake", None))

    # Tokens of deferred prepares computed at once. A longer prompt goes in parts of whole blocks, each on the blocks
    # the last one cached (`idle_part`).
    IDLE_BATCH_TOKENS = IDLE_BATCH_TOKENS

    def _start_idle(self, engine: Any) -> None:
        """Add deferred prepares while nothing else runs: up to `IDLE_BATCH_TOKENS` tokens to compute, those not
        cached by now; a prompt with more goes in parts (its future set when its last part is done)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        bs = self.config.block_size
        budget = self.IDLE_BATCH_TOKENS
        while self._idle and budget > 0:
            ids, done = self._idle.popleft()
            if not done.running() and not done.set_running_or_notify_cancel():  # cancelled while queued
                continue
            have = self._probe.cached_blocks(ids[:-1]) * bs if self._probe is not None else 0
            computed, reached = self._idle_parts.get(done, (0, 0))
            if self._probe is not None and have >= len(ids) - 1 - (len(ids) - 1) % bs:
                self._idle_parts.pop(done, None)
                done.set_result(computed)
                continue
            start, cut = idle_part(have, reached, budget, bs)
            part = self._probe is not None and cut < len(ids) - 1
            prompt = ids[: cut + 1] if part else ids  # one token past the part: its last block is cached too
            rid = f"spanq-idle-{next(self._ids)}"
            try:
                params = SamplingParams(max_tokens=1, temperature=0.0)
                if self.tier is not None:
                    params.extra_args = tier.tier_params()  # a span prepare: saved to the tier
                engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
            except Exception as e:  # noqa: BLE001  (a deferred prepare is an optimisation, never an error)
                log.warning("a deferred span prepare was refused: %s", e)
                self._idle_parts.pop(done, None)
                settle_deferred(done, e)
                continue
            self._idle_running[rid] = (len(prompt) - 1, done, not part)
            between_parts(done, False)
            if part:
                self._idle_parts[done] = (computed, cut)
                self._idle.appendleft((ids, done))  # the rest, first, once this part is done
            budget = budget_after(budget, len(prompt) - 1 - start, bs)  # (its last token is the pad)

    def _answer_settled(self) -> None:
        """Tell `settle` callers once no deferred prepare is waiting or running."""
        if self._settle_waiters and not self._idle and not self._idle_running:
            for waiter in self._settle_waiters:
                if not waiter.done():
                    waiter.set_result(True)
            self._settle_waiters.clear()

    def run_when_idle(self, items: list[tuple[list[int], concurrent.futures.Future[int]]]) -> None:
        """Compute these prompts (each `max_tokens=1`) when the engine has no other request, each future set to
        the tokens it computed (cancelled if the engine closes first): deferred span prepares
        (`SpanGenerator.defer`)."""
        if not items:
            return
        try:
            self._put(("idle", items))
        except BackendUnavailableError:
            for _, done in items:
                settle_deferred(done, "the engine is closed")

    @staticmethod
    async def _attention_scores(probe_id: str) -> dict[str, Any] | None:
        """An attention probe's result: this engine's worker runs in this process (`attention_probe.take`)."""
        from spanq_backend.vllm_integration.attention_probe import take

        return take(probe_id)

    def settle(self, timeout: float = 600.0) -> bool:
        """Wait until every deferred prepare handed to this engine so far is done (benchmarks and tests measure
        a warm query after it); False if `timeout` passed first."""
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()
        try:
            self._put(("settle", done))
        except BackendUnavailableError:
            return False  # closed: nothing will settle
        try:
            return done.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            return False

    def _handle(self, engine: Any, cmd: tuple) -> None:
        kind, req = cmd
        if kind == "add":
            self._start(engine, req)
        elif kind == "idle":
            self._idle.extend(req)
        elif kind == "settle":
            self._settle_waiters.append(req)
        elif kind == "reset":
            if self._pins is not None:
                self._pins.release()  # (a pinned block is referenced: vLLM would refuse the reset)
            req.set_result(bool(engine.reset_prefix_cache()))
        elif kind == "pin":
            hashes, done = req
            try:
                done.set_result(self._pins.pin(hashes) if self._pins is not None else {"refused": len(hashes)})
            except Exception as e:  # noqa: BLE001  (the caller's to report; the engine goes on)
                done.set_exception(e)
        elif kind == "unpin":
            req.set_result(self._pins.release() if self._pins is not None else 0)
        elif kind == "abort" and req.rid in self._active:
            engine.abort_request([req.rid])
            self._active.pop(req.rid, None)

    def _start(self, engine: Any, req: _Request) -> None:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        try:
            engine.add_request(req.rid, TokensPrompt(prompt_token_ids=req.prompt_ids), req.params)
        except (ValueError, TypeError, VLLMClientError) as e:  # the request's own values: the caller's to fix
            self._send(req, engine_error(e))
            return
        except Exception as e:  # anything else is the engine's: a server error, not a 400
            log.exception("the engine could not take a request")
            self._send(req, BackendError(f"the embedded engine could not take the request: {e}"))
            return
        req.added_at_step = self.steps
        self._active[req.rid] = req
        req.prompt_ids = []  # given to vLLM: `recent` keeps the request's steps, not 256 prompts' tokens
        self.recent.append(req)

    def _deliver(self, engine: Any, out: Any) -> None:
        if out.request_id in self._idle_running:
            if out.finished:
                length, done, last = self._idle_running.pop(out.request_id)
                before, reached = self._idle_parts.pop(done, (0, 0))
                computed = before + max(0, length - (out.num_cached_tokens or 0))
                if last:
                    done.set_result(computed)  # counted by its generator
                else:
                    self._idle_parts[done] = (computed, reached)
                    between_parts(done, True)  # its next part starts when no call runs
            return
        req = self._active.get(out.request_id)
        if req is None:
            return
        if req.first_output_step < 0:
            req.first_output_step = self.steps
        self._send(req, out)
        if out.finished:
            self._active.pop(req.rid, None)

    def _send(self, req: _Request, item: Any) -> None:
        try:
            req.loop.call_soon_threadsafe(req.out.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone; nobody is waiting
            pass

    # ----------------------------------------------------------------------------------------- callers

    def _put(self, cmd: tuple) -> None:
        """Queue a command for the engine's thread; `BackendUnavailableError` once it has stopped (checked and
        queued under one lock with its stopping, so nothing is queued that it will not answer)."""
        with self._submit_lock:
            if self._closed:
                raise BackendUnavailableError(self._failure or "the embedded engine is closed")
            self._cmds.put(cmd)

    def _submit(self, prompt_ids: list[int], params: Any) -> _Request:
        loop = asyncio.get_running_loop()
        req = _Request(f"spanq-{next(self._ids)}", prompt_ids, params, loop, asyncio.Queue())
        self._put(("add", req))
        return req

    def _stream(self, prompt_ids: list[int], params: Any) -> AsyncIterator[Any]:
        """`SpanGenerator`'s way onto this engine: submitted to the engine thread at once (in a `batch`, before
        its next step); the outputs come from the returned iterator, which aborts the request when closed early."""
        return _Outputs(self, self._submit(prompt_ids, params))

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Requests submitted inside reach the engine in one step: the engine thread adds them and steps only
        when the block is left."""
        self._put(("hold", None))
        try:
            yield
        finally:
            with contextlib.suppress(BackendUnavailableError):
                self._put(("release", None))

    async def run_tokens(
        self, prompt_ids: list[int], params: Any, table: SpanTable | None = None,
        on_text: TokenCallback | None = None,
    ) -> tuple[list[Any], float | None]:
        """Run one request to the end; returns its outputs (deltas) and the time its first text arrived."""
        run = await self.generator.run(prompt_ids, params, table, on_text)
        return run.outputs, run.first_text_at

    def lower(self, call: Generate) -> LoweredPrompt:
        return self.generator.lower(call)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (spans included, pinned ones too: the pins go), on the engine's thread; False
        while requests run."""
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self._put(("reset", done))
        return done.result(timeout=60)

    async def prepare(self, lowered: LoweredPrompt) -> int:
        """Put every span's isolated KV in the cache (one `[anchor][span]` request each, run together).

        Returns how many spans had to be computed (the others were already cached)."""
        return await self.generator.prepare(lowered)

    async def compile(self, texts: list[str], pin: bool = False) -> dict[str, Any]:
        """Compute each document's span KV (its `[anchor][span]` under this engine's default anchor and lead-in,
        exactly as a query's `plus` of it is prepared) and, on an engine with a tier, write it there: a later
        engine on the same tier answers queries over them without computing them. Documents whose span the tier
        holds already are skipped; one too long for the context window is counted (`too_long`, their indices in
        `too_long_documents`) and the rest compiled. Returns counts: documents, spans (distinct), already held,
        prepared, tokens computed, and the tier's blocks and bytes written (`serving/corpus.compile_corpus`).

        `pin`: the corpus stays in this engine's KV cache until `unpin` (or `reset_prefix_cache`) whatever else
        runs, and in the tier (never evicted from it); spans the tier holds are loaded into the cache to be pinned.
        At most half the cache's blocks are pinned; the report says how many blocks were pinned (`pinned_blocks`)
        and how many could not be (`pin_refused`: past that half; `pin_missing`: evicted before the pin)."""
        from spanq_backend.serving.corpus import compile_corpus

        if pin and self._pins is None:
            raise BackendError("this engine cannot pin spans: its spans are off or its cache cannot be reached")
        before = self.tier.stats.as_dict() if self.tier is not None else {}

        async def pin_blocks(hashes: list[Any]) -> dict[str, int]:  # on the engine's thread, between two steps
            done: concurrent.futures.Future[dict[str, int]] = concurrent.futures.Future()
            self._put(("pin", (hashes, done)))
            return await asyncio.wrap_future(done)

        def tier_held(prompt: list[int]) -> None:
            if self.config.tier_pin:
                self.tier.pin(list(self._probe.tier_keys(prompt) or ()))  # type: ignore[union-attr]

        report, pinned = await compile_corpus(
            self.generator, texts, pin=pin_blocks if pin else None, skip_tier_held=self.tier is not None,
            on_tier_held=tier_held,
        )  # fmt: skip
        if self.tier is not None:
            # every block of the corpus on disk before the report (however slow the disk: no timeout)
            await asyncio.get_running_loop().run_in_executor(None, lambda: self.tier.flush(timeout=None))
            if pinned:
                self.tier.pin([h for p in pinned for h in (self._probe.tier_keys(p) or ())])  # type: ignore[union-attr]
            after = self.tier.stats.as_dict()
            report["blocks_written"] = after["saved_blocks"] - before["saved_blocks"]
            report["bytes_written"] = after["bytes_written"] - before["bytes_written"]
            report["blocks_evicted"] = after["evicted_blocks"] - before["evicted_blocks"]  # (past the capacity)
        return report

    def unpin(self) -> int:
        """Drop the pins `compile(..., pin=True)` took in this engine's KV cache (the blocks stay cached, evicted
        as any other from now on; the tier's pins stay: `spanq tier --clear` removes them). How many blocks."""
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._put(("unpin", done))
        return done.result(timeout=60)

    @property
    def pinned_blocks(self) -> int:
        """Blocks of this engine's KV cache held pinned now."""
        pins = getattr(self, "_pins", None)  # (none before the engine is built)
        return len(pins.held) if pins is not None else 0

    def tier_stats(self) -> dict[str, Any] | None:
        """The span tier's counters (loads, blocks loaded and saved, failures, bytes), or None without a tier."""
        if self.tier is None:
            return None
        return {"dir": str(self.tier.dir), "blocks": len(self.tier), **self.tier.stats.as_dict()}

    async def generate(
        self,
        call: Generate,
        *,
        path: str = "$",
        on_token: TokenCallback | None = None,
        span_output: bool = False,
    ) -> Completion:
        """Run one closed `Generate`: lower, prepare spans, run; with TTFT and cache usage measured.
        `span_output`: an outer generate reads the output as a span (`SpanGenerator.generate`)."""
        return await self.generator.generate(call, path=path, on_token=on_token, span_output=span_output)

    def join(self, timeout: float | None = 30) -> None:
        """Wait for the engine's thread to have stopped (closed or failed) and let go of vLLM's engine."""
        self._thread.join(timeout=timeout)

    @property
    def closed(self) -> bool:
        """Whether the engine has stopped (closed, or failed in its thread: `failure` says why)."""
        return self._closed

    @property
    def failure(self) -> str | None:
        """Why the engine's thread stopped, where it failed; None where it runs or was closed."""
        return self._failure

    def close(self) -> None:
        """Stop the engine: calls under way or queued end with `BackendUnavailableError`; its memory goes."""
        with self._submit_lock:
            if self._closed:
                return
            self._cmds.put(("stop", None))  # (the thread sets `_closed` as it stops, and answers what is queued)
        self._thread.join(timeout=30)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

