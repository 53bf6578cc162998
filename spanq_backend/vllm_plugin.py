"""The span-aware pieces installed into vLLM through the `vllm.general_plugins` entry point (no fork).

`register()` runs in every vLLM process (driver, engine core, workers) and patches these hooks, all listed in
`vllm_symbols`:
1. the engine core's request block hasher → `span_block_hashes` for requests that carry a span table, once
   the engine has checked that it may (2);
2. `EngineCore._initialize_kv_caches` → once the KV cache exists, every worker is asked (`WORKER_STATUS_METHOD`, added to vLLM's
   `WorkerBase`) whether its model runner moves span keys for the loaded model; unless all do, span tables
   are ignored and requests run as stock (`SpanSupport`): never a span block at a new position with keys
   that were not moved;
3. `KVCacheManager.get_computed_blocks` → after the cache lookup, blocks of spans that missed are re-keyed
   as context, so KV computed in context is never registered under a span's key (isolation); and CIDRA
   plans the hit: blocks that running requests read at another position get a private copy;
4. the single-type KV manager's `get_num_blocks_to_allocate` / `allocate_new_blocks` → those copies are
   counted against capacity before admission and made through vLLM's own copy-on-write path;
5. the CPU model runner's `execute_model` (and the block-copy step inside it) → before the forward pass,
   blocks whose keys encode another position are re-rotated (ReRoPE), tracked block by block, after the
   step's copies ran.
Requests without a span table keep stock hashing and never need a move (invariant 7). Set
`SPANQ_DISABLE_PLUGIN=1` to load vLLM without any of it (for side-by-side stock measurements).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .span_hashing import span_block_hashes
from .span_table import SpanTable, SpanTableError

__all__ = [
    "WORKER_STATUS_METHOD",
    "SpanRuntime",
    "SpanSupport",
    "query_span_support",
    "register",
    "runner_span_status",
    "runtime_of",
    "stats",
]

log = logging.getLogger("spanq.vllm_plugin")

CONTEXT_TAG = "spanq-ctx"
_registered = False


def _span_table(request: Any) -> SpanTable | None:
    cached = getattr(request, "_spanq_table", False)
    if cached is not False:
        return cached
    params = getattr(request, "sampling_params", None)
    try:
        table = SpanTable.from_extra_args(getattr(params, "extra_args", None)) if params is not None else None
    except SpanTableError as e:  # a client's malformed table: the request runs as stock, the engine goes on
        log.warning("request %s: span table ignored (%s); hashed as stock", getattr(request, "request_id", "?"), e)
        table = None
    if table is not None and not table.spans:
        table = None
    try:
        request._spanq_table = table
    except AttributeError:
        pass
    return table


# --------------------------------------------------------------------------------------------- span support


@dataclass(frozen=True)
class SpanSupport:
    """Whether an engine honours span tables. Only where every worker has a live relocation runtime for the
    loaded model: a span block found at a new position must have its keys moved, and only a hooked runner with
    a runtime moves them. Anywhere else a span table is ignored and the request runs as a stock request."""

    enabled: bool
    reason: str = ""  # why not, when not

    @classmethod
    def of_workers(cls, statuses: Sequence[Sequence[Any]]) -> SpanSupport:
        """The engine's answer from every worker's `(ok, reason)`."""
        if not statuses:
            return cls(False, "the engine reported no workers")
        problems = [f"worker {i}: {why}" for i, (ok, why) in enumerate(statuses) if not ok]
        return cls(False, "; ".join(problems)) if problems else cls(True)


UNCHECKED = SpanSupport(False, "the engine has not checked its workers yet")

# The method the plugin adds to vLLM's workers, reached through `collective_rpc` by name (a name travels
# between the front end, the engine core and the workers, a function does not).
WORKER_STATUS_METHOD = "spanq_span_status"


def runner_span_status(runner: Any) -> tuple[bool, str]:
    """`(True, "")` when this model runner moves span keys for its model, else `(False, why)`."""
    if runner is None:
        return False, "the worker has no model runner"
    if not getattr(getattr(type(runner), "execute_model", None), "__spanq_hook__", False):
        return False, (
            f"{type(runner).__name__} is not hooked by spanq, so cached keys would never be moved "
            "(spanq moves keys on vLLM's CPU model runner only)"
        )
    if not getattr(runner, "kv_caches", None):
        return False, "the KV cache is not allocated"
    if runtime_of(runner) is None:
        return False, _runtime_errors.get(runner, "no relocation runtime")
    return True, ""


def _worker_span_status(worker: Any) -> tuple[bool, str]:
    """Installed on vLLM's `WorkerBase` as `WORKER_STATUS_METHOD`."""
    try:
        return runner_span_status(getattr(worker, "model_runner", None))
    except Exception as e:  # noqa: BLE001  (any failure means: no spans here)
        return False, f"checking the model runner failed: {type(e).__name__}: {e}"


def query_span_support(collective_rpc: Callable[[str], Any]) -> SpanSupport:
    """Ask every worker of an engine (through its `collective_rpc`) whether it moves span keys."""
    try:
        statuses = collective_rpc(WORKER_STATUS_METHOD)
    except Exception as e:  # noqa: BLE001  (a worker without the plugin cannot answer: no spans)
        return SpanSupport(False, f"the workers could not answer ({type(e).__name__}: {e}); "
                           "is the spanq plugin loaded in every vLLM process?")
    return SpanSupport.of_workers(statuses)


async def aquery_span_support(collective_rpc: Callable[[str], Any]) -> SpanSupport:
    """`query_span_support` for an async engine client (`AsyncLLM.collective_rpc`)."""
    try:
        statuses = await collective_rpc(WORKER_STATUS_METHOD)
    except Exception as e:  # noqa: BLE001
        return SpanSupport(False, f"the workers could not answer ({type(e).__name__}: {e}); "
                           "is the spanq plugin loaded in every vLLM process?")
    return SpanSupport.of_workers(statuses)


# --------------------------------------------------------------------------------------------- scheduler side

_hash_fn: Any = None


class SpanBlockHasher:
    """The engine core's request block hasher: span-aware for requests with a span table, once the engine's
    workers have said they move keys (`support`, set when the engine core has started); stock otherwise."""

    def __init__(self, stock: Any, hash_block_size: int, caching_hash_fn: Any):
        from vllm.v1.core import kv_cache_utils as kcu

        self.stock = stock
        self.hash_block_size = hash_block_size
        self.support = UNCHECKED
        self._warned = False

        def hash_block(parent: Any, tokens: Any, extra: Any) -> Any:
            return kcu.hash_block_tokens(caching_hash_fn, parent, tokens, extra)

        self._hash_block = hash_block
        self._extra_keys = kcu.generate_block_hash_extra_keys

    def __call__(self, request: Any) -> list[Any]:
        table = _span_table(request)
        if table is not None and not request.block_hashes:  # a new request: its table is checked once
            problem = self._refusal(table, request.num_prompt_tokens)
            if problem is not None:
                table = request._spanq_table = None  # every other hook now sees a stock request
                if self.support.enabled:
                    log.warning("request %s: span table ignored (%s); hashed as stock", request.request_id, problem)
                elif not self._warned:
                    self._warned = True
                    log.warning("spanq: span tables are ignored by this engine; they run as stock requests: %s",
                                problem)
        if table is None:
            return self.stock(request)

        def extra_keys(start: int, end: int) -> Any:
            return self._extra_keys(request, start, end, 0)[0]

        return span_block_hashes(request.all_token_ids, table, self._hash_block, request.block_hashes, extra_keys)

    def _refusal(self, table: SpanTable, num_prompt_tokens: int) -> str | None:
        if not self.support.enabled:
            return self.support.reason
        if table.block_size != self.hash_block_size:
            return f"built for blocks of {table.block_size}, the engine uses {self.hash_block_size}"
        try:
            table.validate(num_prompt_tokens)
        except SpanTableError as e:
            return str(e)
        return None


# What an engine core's workers said at start-up, waiting for the hasher that the same `EngineCore.__init__`
# builds next, on the same thread (the plugin itself may only be loaded inside that `__init__`, so the hooks
# are the KV cache set-up and the hasher factory it calls by name, not `__init__` itself).
_startup = threading.local()


def _wrap_initialize_kv_caches(orig: Any) -> Any:
    def _initialize_kv_caches(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, *args, **kwargs)
        support = query_span_support(self.collective_rpc)
        if not support.enabled:
            log.warning("spanq: span reuse is off for this engine (span tables run as stock requests): %s",
                        support.reason)
        _startup.support = support
        return result

    _initialize_kv_caches.__wrapped__ = orig  # type: ignore[attr-defined]
    return _initialize_kv_caches


def _make_hasher_factory(stock_factory: Any) -> Any:
    def get_request_block_hasher(hash_block_size: int, caching_hash_fn: Any) -> Any:
        global _hash_fn
        _hash_fn = caching_hash_fn
        hasher = SpanBlockHasher(stock_factory(hash_block_size, caching_hash_fn), hash_block_size, caching_hash_fn)
        hasher.support = getattr(_startup, "support", UNCHECKED)
        _startup.support = UNCHECKED
        return hasher

    return get_request_block_hasher


def _rekey_missed_spans(request: Any, num_computed_tokens: int) -> int:
    """Re-key blocks from the first span block that missed the cache: they will be computed in context."""
    table = _span_table(request)
    if table is None or _hash_fn is None:
        return 0
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    bs = table.block_size
    first_hit_free = num_computed_tokens // bs
    missed = [s // bs for s, e in table.spans if e // bs > first_hit_free]
    if not missed:
        return 0
    j0 = max(first_hit_free, min(missed))
    hashes = request.block_hashes
    if j0 >= len(hashes) or getattr(request, "_spanq_rekeyed_from", None) == j0:
        return 0
    tokens = request.all_token_ids
    parent = None  # a stock chain over the whole prefix: the re-keyed blocks depend on every token before them
    for j in range(j0):
        parent = hash_block_tokens(_hash_fn, parent, tokens[j * bs : (j + 1) * bs], (CONTEXT_TAG,))
    for j in range(j0, len(hashes)):
        parent = hash_block_tokens(_hash_fn, parent, tokens[j * bs : (j + 1) * bs], (CONTEXT_TAG,))
        hashes[j] = parent  # in place: vLLM holds views of this list
    request._spanq_rekeyed_from = j0
    log.info("request %s: span blocks from %d missed the cache; computed in context, not cached as spans",
             getattr(request, "request_id", "?"), j0)
    return len(hashes) - j0


# Request id -> hit-block indices that get a private copy, for a request whose cache hit awaits admission.
_cow_plans: dict[str, list[int]] = {}
_planners: weakref.WeakSet = weakref.WeakSet()


def _planner(manager: Any) -> Any:
    planner = getattr(manager, "_spanq_cidra", None)
    if planner is None:
        from .cidra import CidraPlanner

        pool = manager.block_pool
        planner = CidraPlanner(manager.block_size, lambda b: pool.blocks[b].ref_cnt)
        manager._spanq_cidra = planner
        _planners.add(planner)
    return planner


def _wrap_get_computed_blocks(orig: Any) -> Any:
    def get_computed_blocks(self: Any, request: Any) -> Any:
        result = orig(self, request)
        _rekey_missed_spans(request, result[1])
        blocks, num_computed = result[0], result[1]
        if num_computed and len(blocks.blocks) == 1:
            mgr = self.coordinator.single_type_managers[0]
            hit = [blk.block_id for blk in blocks.blocks[0][: num_computed // mgr.block_size]]
            _cow_plans[request.request_id] = _planner(mgr).plan(hit).duplicate
        return result

    get_computed_blocks.__wrapped__ = orig  # type: ignore[attr-defined]
    return get_computed_blocks


def _wrap_get_num_blocks_to_allocate(orig: Any) -> Any:
    def get_num_blocks_to_allocate(self: Any, request_id: str, *args: Any, **kwargs: Any) -> int:
        n = orig(self, request_id, *args, **kwargs)
        if request_id not in self.num_cached_block:  # a first allocation: its duplicates need blocks too
            n += len(_cow_plans.get(request_id, ()))
        return n

    get_num_blocks_to_allocate.__wrapped__ = orig  # type: ignore[attr-defined]
    return get_num_blocks_to_allocate


def _wrap_allocate_new_blocks(orig: Any) -> Any:
    def allocate_new_blocks(self: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        req_blocks = self.req_to_blocks[request_id]
        plan = _cow_plans.pop(request_id, None)
        duplicated = []
        for idx in plan or ():
            copy = self.block_pool.get_new_blocks(1)[0]
            self._apply_cow(request_id, idx, req_blocks[idx], copy)  # copied before the forward pass
            duplicated.append(copy)
        # Positions to record: every block when a cache hit was just admitted, else only the blocks added now
        # (a running request's earlier blocks keep theirs: no per-step walk over every block it holds).
        first = 0 if plan is not None else len(req_blocks)
        new_blocks = orig(self, request_id, *args, **kwargs)
        _planner(self).admitted([b.block_id for b in req_blocks[first:]], first)
        return duplicated + list(new_blocks)

    allocate_new_blocks.__wrapped__ = orig  # type: ignore[attr-defined]
    return allocate_new_blocks


# --------------------------------------------------------------------------------------------- runner side


class SpanRuntime:
    """Per model runner: the block position tracker and the relocator over its KV caches."""

    def __init__(self, runner: Any):
        from .kv_layout import discover_cpu_k_layout, rope_spec_of_model
        from .relocation import BlockPositionTracker, KVRelocator

        cfg = runner.cache_config
        self.block_size = int(cfg.block_size)
        kv_caches = [t for t in runner.kv_caches if t is not None]
        self.tracker = BlockPositionTracker(self.block_size, int(kv_caches[0].shape[0]) if kv_caches else 0)
        spec = rope_spec_of_model(runner.get_model())
        layout = discover_cpu_k_layout(runner, self.block_size, spec.head_dim)
        self.relocator = KVRelocator(kv_caches, layout, spec)
        # Build or load the compiled op now, at start-up, not in the middle of the first step that moves keys.
        log.info("spanq: keys move with %s", "the compiled CPU op" if self.relocator.uses_compiled_kernel else "torch")
        self.pending: list[Any] = []

    def before_step(self, scheduler_output: Any) -> None:
        """Plan this step's moves; apply them now, or right after the step's block copies if it has any."""
        tracker = self.tracker
        for req_id in scheduler_output.finished_req_ids:
            tracker.finish(req_id)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            tracker.finish(req_id)  # its blocks were freed; it comes back as a resumed request
        copies = getattr(scheduler_output, "kv_cache_block_copies", None) or ()
        for c in copies:  # a copy's keys encode what its source's encode
            tracker.copied(c.src_block_id, c.dst_block_id)
        moves = []
        for req in scheduler_output.scheduled_new_reqs:
            moves += tracker.new_request(req.req_id, req.block_ids[0], req.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                if new_blocks is not None:
                    moves += tracker.new_request(req_id, new_blocks[0], cached.num_computed_tokens[i])
            elif new_blocks is not None and new_blocks[0]:
                tracker.extend_request(req_id, new_blocks[0])
        self.pending = moves
        if not copies:
            self.flush()

    def flush(self) -> None:
        """Apply the planned moves (after this step's block copies, before its forward pass)."""
        moves, self.pending = self.pending, []
        if moves:
            self.relocator.apply(moves)


# Per model runner (weakly: an engine's runner goes away with it, and a new one must not inherit its answer).
_runtimes: weakref.WeakKeyDictionary[Any, SpanRuntime | None] = weakref.WeakKeyDictionary()
_runtime_errors: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def runtime_of(runner: Any) -> SpanRuntime | None:
    """The runner's span runtime; None where keys cannot be moved (the engine then serves stock requests only).

    spanq's own engines refuse such models before they start (`kv_layout.check_relocatable`); any other vLLM
    in this environment loads the plugin too and must keep serving as stock."""
    if runner not in _runtimes:
        try:
            _runtimes[runner] = SpanRuntime(runner)
        except Exception as e:  # noqa: BLE001  (a runtime that cannot start means: no spans on this engine)
            log.warning("span reuse is off for this engine: %s", e)
            _runtime_errors[runner] = f"keys cannot be moved for this model: {e}"
            _runtimes[runner] = None
    return _runtimes[runner]


_current: SpanRuntime | None = None  # the runtime whose step is between its copies and its forward pass


def _wrap_execute_model(orig: Any) -> Any:
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        global _current
        if not getattr(self, "kv_caches", None):
            return orig(self, scheduler_output, *args, **kwargs)
        rt = runtime_of(self)
        if rt is None:
            return orig(self, scheduler_output, *args, **kwargs)
        rt.before_step(scheduler_output)
        _current = rt
        try:
            return orig(self, scheduler_output, *args, **kwargs)
        finally:
            _current = None
            rt.flush()  # only if the step had copies but never ran them (nothing else is pending)

    execute_model.__wrapped__ = orig  # type: ignore[attr-defined]
    execute_model.__spanq_hook__ = True  # type: ignore[attr-defined]  # what `runner_span_status` looks for
    return execute_model


def _wrap_copy_blocks(orig: Any) -> Any:
    def copy_kv_cache_blocks_inplace(*args: Any, **kwargs: Any) -> Any:
        result = orig(*args, **kwargs)
        if _current is not None:
            _current.flush()
        return result

    copy_kv_cache_blocks_inplace.__wrapped__ = orig  # type: ignore[attr-defined]
    return copy_kv_cache_blocks_inplace


# --------------------------------------------------------------------------------------------- entry point


def register() -> None:
    """vLLM plugin entry point: install the span-aware hooks once per process."""
    global _registered
    if _registered or os.environ.get("SPANQ_DISABLE_PLUGIN", "") not in ("", "0"):
        return
    from . import vllm_symbols

    vllm_symbols.check_symbols()
    from vllm.v1.core import kv_cache_manager, single_type_kv_cache_manager
    from vllm.v1.engine import core as engine_core
    from vllm.v1.worker import cpu_model_runner, gpu_model_runner, worker_base

    engine_core.get_request_block_hasher = _make_hasher_factory(engine_core.get_request_block_hasher)
    core = engine_core.EngineCore
    core._initialize_kv_caches = _wrap_initialize_kv_caches(core._initialize_kv_caches)
    setattr(worker_base.WorkerBase, WORKER_STATUS_METHOD, _worker_span_status)
    mgr = kv_cache_manager.KVCacheManager
    mgr.get_computed_blocks = _wrap_get_computed_blocks(mgr.get_computed_blocks)
    single = single_type_kv_cache_manager.FullAttentionManager
    single.get_num_blocks_to_allocate = _wrap_get_num_blocks_to_allocate(single.get_num_blocks_to_allocate)
    single.allocate_new_blocks = _wrap_allocate_new_blocks(single.allocate_new_blocks)
    runner = cpu_model_runner.CPUModelRunner
    runner.execute_model = _wrap_execute_model(runner.execute_model)
    gpu_model_runner.copy_kv_cache_blocks_inplace = _wrap_copy_blocks(gpu_model_runner.copy_kv_cache_blocks_inplace)
    _registered = True
    log.debug("spanq vLLM plugin registered")


def stats() -> dict[str, int]:
    """Span-runtime counters of this process (in-process engines only): moves, duplicates, conflicts, and how
    many runners move keys with spanq's compiled CPU op (`kernels.relocate_keys_op`) rather than plain torch."""
    planners = list(_planners)
    runtimes = [rt for rt in _runtimes.values() if rt]
    return {
        "moved_blocks": sum(rt.relocator.moved_blocks for rt in runtimes),
        "compiled_runners": sum(rt.relocator.uses_compiled_kernel for rt in runtimes),
        "conflicts": sum(rt.tracker.conflicts for rt in runtimes),
        "duplicates": sum(p.duplicates_planned for p in planners),
    }
