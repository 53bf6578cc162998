"""The span-aware pieces installed into vLLM through the `vllm.general_plugins` entry point (no fork).

`register()` runs in every vLLM process (driver, engine core, workers) and patches three hooks, all listed in
`vllm_symbols`:
1. the engine core's request block hasher → `span_block_hashes` for requests that carry a span table;
2. `KVCacheManager.get_computed_blocks` → after the cache lookup, blocks of spans that missed are re-keyed
   as context, so KV computed in context is never registered under a span's key (isolation); and CIDRA
   plans the hit: blocks that running requests read at another position get a private copy;
3. the single-type KV manager's `get_num_blocks_to_allocate` / `allocate_new_blocks` → those copies are
   counted against capacity before admission and made through vLLM's own copy-on-write path;
4. the model runner's `execute_model` (and the block-copy step inside it) → before the forward pass,
   blocks whose keys encode another position are re-rotated (ReRoPE), tracked block by block, after the
   step's copies ran.
Requests without a span table keep stock hashing and never need a move (invariant 7). Set
`SPANQ_DISABLE_PLUGIN=1` to load vLLM without any of it (for side-by-side stock measurements).
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

from .span_hashing import span_block_hashes
from .span_table import SpanTable, SpanTableError

__all__ = ["SpanRuntime", "register", "runtime_of", "stats"]

log = logging.getLogger("spanq.vllm_plugin")

CONTEXT_TAG = "spanq-ctx"
_registered = False


def _span_table(request: Any) -> SpanTable | None:
    cached = getattr(request, "_spanq_table", False)
    if cached is not False:
        return cached
    params = getattr(request, "sampling_params", None)
    table = SpanTable.from_extra_args(getattr(params, "extra_args", None)) if params is not None else None
    if table is not None and not table.spans:
        table = None
    try:
        request._spanq_table = table
    except AttributeError:
        pass
    return table


# --------------------------------------------------------------------------------------------- scheduler side

_hash_fn: Any = None


def _make_hasher_factory(stock_factory: Any) -> Any:
    from vllm.v1.core import kv_cache_utils as kcu

    def get_request_block_hasher(hash_block_size: int, caching_hash_fn: Any) -> Any:
        global _hash_fn
        _hash_fn = caching_hash_fn
        stock = stock_factory(hash_block_size, caching_hash_fn)

        def hash_block(parent: Any, tokens: Any, extra: Any) -> Any:
            return kcu.hash_block_tokens(caching_hash_fn, parent, tokens, extra)

        def request_block_hasher(request: Any) -> list[Any]:
            table = _span_table(request)
            if table is not None and not request.block_hashes:
                try:
                    if table.block_size != hash_block_size:
                        raise SpanTableError(f"built for blocks of {table.block_size}, the engine uses {hash_block_size}")
                    table.validate(request.num_prompt_tokens)
                except SpanTableError as e:
                    log.warning("request %s: span table ignored (%s); hashed as stock", request.request_id, e)
                    table = request._spanq_table = None
            if table is None:
                return stock(request)

            def extra_keys(start: int, end: int) -> Any:
                return kcu.generate_block_hash_extra_keys(request, start, end, 0)[0]

            return span_block_hashes(request.all_token_ids, table, hash_block, request.block_hashes, extra_keys)

        return request_block_hasher

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


_runtimes: dict[int, SpanRuntime | None] = {}


def runtime_of(runner: Any) -> SpanRuntime | None:
    """The runner's span runtime; None where keys cannot be moved (the engine then serves stock requests only).

    spanq's own engines refuse such models before they start (`kv_layout.check_relocatable`); any other vLLM
    in this environment loads the plugin too and must keep serving as stock."""
    if id(runner) not in _runtimes:
        from .rerope import RelocationError

        try:
            _runtimes[id(runner)] = SpanRuntime(runner)
        except RelocationError as e:
            log.warning("span reuse is off for this engine: %s", e)
            _runtimes[id(runner)] = None
    return _runtimes[id(runner)]


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
    from vllm.v1.worker import cpu_model_runner, gpu_model_runner

    engine_core.get_request_block_hasher = _make_hasher_factory(engine_core.get_request_block_hasher)
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
