"""The patches that run in vLLM's engine core process (the scheduler and its KV cache manager). Invariants
are numbered as in docs/design.md.

- the request block hasher (`SpanBlockHasher`): span blocks hash from their anchor (invariant 3), once the
  engine's workers have said they move keys (invariant 9); stock otherwise (invariant 7);
- the KV cache set-up: right after it, the workers are asked (`support.query_span_support`);
- the cache lookup: blocks of spans that missed are re-keyed as context (isolation, invariant 1), and CIDRA
  plans the hit: blocks that running requests read at another position get a private copy (invariant 6);
- the single-type KV manager's allocation: those copies are counted before admission and made through
  vLLM's own copy-on-write path.

State: `request_spans` (per vLLM `Request`: its span table and re-keying), `manager_spans` (per
`FullAttentionManager`: its CIDRA planner and the copies planned for requests awaiting admission), and the
hasher itself (per engine core: its span support and hash function).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from spanq_backend.kv.cidra import CidraPlanner, StepPlan
from spanq_backend.kv.span_hashing import AnchorHash, anchor_chain, span_block_hashes
from spanq_backend.kv.span_table import SpanTable, SpanTableError
from spanq_backend.vllm_integration.attention_probe import PROBE_PARAM
from spanq_backend.vllm_integration.cache_probe import BlockPins
from spanq_backend.vllm_integration.state import Extension
from spanq_backend.vllm_integration.support import (
    STOCK,
    UNCHECKED,
    SpanSupport,
    query_span_support,
    started_stock,
)

__all__ = [
    "CONTEXT_TAG",
    "PINNED_METHOD",
    "PIN_METHOD",
    "UNPIN_METHOD",
    "SpanBlockHasher",
    "engine_pins",
    "make_hasher_factory",
    "manager_spans",
    "pin_blocks",
    "pinned_blocks",
    "rekey_after_connector",
    "rekey_missed_spans",
    "request_spans",
    "restore_span_keys",
    "span_table_of",
    "unpin_blocks",
    "wrap_allocate_new_blocks",
    "wrap_get_computed_blocks",
    "wrap_get_num_blocks_to_allocate",
    "wrap_initialize_kv_caches",
]

log = logging.getLogger("spanq.vllm")

HASHING = {"seconds": 0.0, "requests": 0}  # host time this process spent hashing span tables' blocks

CONTEXT_TAG = "spanq-ctx"  # extra key of blocks re-keyed as context: never equal to a span's or a stock hash


# --------------------------------------------------------------------------------------------- per request


@dataclass
class RequestSpans:
    """What the plugin knows of one vLLM request."""

    table: SpanTable | None  # None: a stock request (no table, or one that was refused)
    hash_fn: Any = None  # the engine core's block hash function, once its hasher saw the request
    rekeyed_from: int | None = None  # first block re-keyed as context, if any
    # The span keys re-keying replaced, from block `keys_from` on (what a span tier's lookup restores: it looks
    # for span blocks past the engine's own hit before they are re-keyed, `restore_span_keys`)
    span_keys: list[Any] | None = None
    keys_from: int = 0
    # The request's own keys as its hasher made them, from block `own_from` on, kept at its first re-keying: each
    # re-keyed block carries its own key, the same whichever lookup re-keyed it (a second one after a preemption).
    own_keys: list[Any] | None = None
    own_from: int = 0


def _read_table(request: Any) -> RequestSpans:
    params = getattr(request, "sampling_params", None)
    try:
        table = SpanTable.from_extra_args(getattr(params, "extra_args", None)) if params is not None else None
    except SpanTableError as e:  # a client's malformed table: the request runs as stock, the engine goes on
        log.warning("request %s: span table ignored (%s); hashed as stock", getattr(request, "request_id", "?"), e)
        table = None
    return RequestSpans(table if table is not None and table.spans else None)


request_spans: Extension[RequestSpans] = Extension("vllm.v1.request.Request", _read_table)


def span_table_of(request: Any) -> SpanTable | None:
    """The span table the plugin honours for this request (None: stock)."""
    return request_spans(request).table


# --------------------------------------------------------------------------------------------- the hasher


class SpanBlockHasher:
    """An engine core's request block hasher: span-aware for requests with a span table, once the engine's
    workers have said they move keys (`support`, set when the engine core starts); stock otherwise."""

    def __init__(self, stock: Any, hash_block_size: int, hash_fn: Any, support: SpanSupport = UNCHECKED):
        from vllm.v1.core import kv_cache_utils as kcu

        self.stock = stock
        self.hash_block_size = hash_block_size
        self.hash_fn = hash_fn
        self.support = support
        self._warned = False
        self._extra_keys = kcu.generate_block_hash_extra_keys

        def hash_block(parent: Any, tokens: Any, extra: Any) -> Any:
            return kcu.hash_block_tokens(hash_fn, parent, tokens, extra)

        self._hash_block = hash_block
        # The hashes of explicit anchors (`anchor_chain`), by the anchor tokens and the extra keys they were hashed
        # with: a call's requests (its answer, each recompute run) carry every span's anchor, often a lead-in of
        # hundreds of tokens each (16 spans: 256 blocks hashed again by every request).
        self._anchor_chains: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._anchor_tokens = 0  # the tokens of the anchors kept

    ANCHOR_TOKENS = 1 << 17  # the anchors' tokens kept, at most (the least recently used dropped past it)

    def __call__(self, request: Any) -> list[Any]:
        state = request_spans(request)
        if state.table is not None and not request.block_hashes:  # a new request: its table is checked once
            state.hash_fn = self.hash_fn
            problem = self._refusal(state.table, request.num_prompt_tokens)
            if problem is not None:
                state.table = None  # every other hook now sees a stock request
                if self.support.enabled:
                    log.warning("request %s: span table ignored (%s); hashed as stock", request.request_id, problem)
                elif not self._warned:
                    self._warned = True
                    log.warning("spanq: span tables are ignored by this engine; they run as stock requests: %s",
                                problem)
        if state.table is None:
            return self.stock(request)
        table = state.table

        def extra_keys(start: int, end: int) -> Any:
            return self._extra_keys(request, start, end, 0)[0]

        started = time.perf_counter()
        try:
            new = span_block_hashes(
                request.all_token_ids, table, self._hash_block, request.block_hashes, extra_keys,
                self._kept_anchors(request, extra_keys),
            )
            return self._probe_salted(request, table, new)
        finally:
            HASHING["seconds"] += time.perf_counter() - started
            HASHING["requests"] += 1

    def _kept_anchors(self, request: Any, extra_keys: Any) -> AnchorHash | None:
        """The hashes of explicit anchors for this request, kept across requests; None where its extra keys depend
        on each block's own content (multimodal inputs, prompt embeddings): hashed for the request alone. Otherwise
        vLLM's extra keys are the same for every block but the first (LoRA; the cache salt is the first block's):
        those two are the key beside the tokens."""
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return None
        bs = self.hash_block_size
        kept = self._anchor_chains
        keys: list[Any] = []  # the first block's extra keys and the rest's, worked out at the first anchor

        def anchor_hash(anchor: tuple[int, ...]) -> Any:
            if not keys:
                keys.extend((extra_keys(0, bs), extra_keys(bs, 2 * bs)))
            first, rest = keys
            key = (anchor, first, rest)
            found = kept.get(key)
            if found is None:
                found = kept[key] = anchor_chain(anchor, bs, self._hash_block, lambda k: first if k == 0 else rest)
                self._anchor_tokens += len(anchor)
                while self._anchor_tokens > self.ANCHOR_TOKENS:
                    self._anchor_tokens -= len(kept.popitem(last=False)[0][0])
            else:
                kept.move_to_end(key)
            return found

        return anchor_hash

    def _probe_salted(self, request: Any, table: SpanTable, new: list[Any]) -> list[Any]:
        """An attention probe's blocks from its question's on (`attention_probe.PROBE_PARAM`), each hashed again
        with the probe's id: the probe computes the question's rows (what it reads) even where the same prompt's
        blocks are cached, and its blocks are found by no other request."""
        params = getattr(request, "sampling_params", None)
        probe = (getattr(params, "extra_args", None) or {}).get(PROBE_PARAM)
        if not isinstance(probe, dict) or not new:
            return new
        first = len(request.block_hashes)  # the index of new[0]
        salt_from = int(probe.get("rows_from", 0)) // table.block_size
        tag = ("spanq-attention-probe", str(probe.get("id", "")))
        return [h if first + k < salt_from else self._hash_block(h, (), tag) for k, h in enumerate(new)]

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


# The workers' answer of an engine core that is starting, waiting for the hasher that the same
# `EngineCore.__init__` builds next, on the same thread. (The plugin may itself be loaded inside that
# `__init__`, so `__init__` cannot be wrapped; the KV cache set-up and the hasher factory are looked up later.)
_startup = threading.local()


def wrap_initialize_kv_caches(orig: Any) -> Any:
    def _initialize_kv_caches(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, *args, **kwargs)
        if started_stock(self.vllm_config):
            _startup.support = STOCK  # nothing to check, nothing to say: the engine said it starts as stock
            return result
        support = query_span_support(self.collective_rpc)
        if not support.enabled:
            log.warning("spanq: span reuse is off for this engine (span tables run as stock requests): %s",
                        support.reason)
        else:
            log.info("span reuse is on: the start-up self-check moved keys exactly on every layer's RoPE")
        _startup.support = support
        return result

    return _initialize_kv_caches


def make_hasher_factory(stock_factory: Any) -> Any:
    """vLLM's `get_request_block_hasher`, returning a `SpanBlockHasher` around the stock hasher."""

    def get_request_block_hasher(hash_block_size: int, caching_hash_fn: Any) -> Any:
        support = getattr(_startup, "support", UNCHECKED)
        _startup.support = UNCHECKED
        stock = stock_factory(hash_block_size, caching_hash_fn)
        return SpanBlockHasher(stock, hash_block_size, caching_hash_fn, support)

    return get_request_block_hasher


# --------------------------------------------------------------------------------------------- isolation


def rekey_missed_spans(request: Any, num_computed_tokens: int, keep_span_keys: bool = False) -> int:
    """Re-key blocks from the first span block that missed the cache: they will be computed in context, so
    their KV must never be found under a span's key (invariant 1). Returns how many blocks were re-keyed.
    `keep_span_keys`: remember the keys replaced, for `restore_span_keys` (a span tier's lookups)."""
    state = request_spans.get(request)
    if state is None or state.table is None or state.hash_fn is None:
        return 0
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    table, hash_fn = state.table, state.hash_fn
    bs = table.block_size
    first_hit_free = num_computed_tokens // bs
    missed = [s // bs for s, e in table.spans if e // bs > first_hit_free]
    if not missed:
        return 0
    j0 = max(first_hit_free, min(missed))
    hashes = request.block_hashes
    if j0 >= len(hashes) or state.rekeyed_from == j0:
        return 0
    if keep_span_keys and state.span_keys is None:
        state.span_keys, state.keys_from = list(hashes[j0:]), j0
    elif keep_span_keys and j0 < state.keys_from:
        state.span_keys, state.keys_from = list(hashes[j0 : state.keys_from]) + state.span_keys, j0
    tokens = request.all_token_ids
    if state.own_keys is None:
        state.own_keys, state.own_from = list(hashes[j0:]), j0
    elif j0 < state.own_from:
        state.own_keys, state.own_from = list(hashes[j0 : state.own_from]) + state.own_keys, j0
    own, own_from = state.own_keys, state.own_from
    # The re-keyed chain starts from the keys of the blocks before it — what this request reads there: a span's
    # KV under its anchor, a block computed in context, the prefix — not from their tokens alone: the same
    # tokens read another way (a span computed in context here, cached as a span there; another anchor) are
    # other KV. Each block also carries its own key, with the cache salt, LoRA and probe tags in it.
    parent = hash_block_tokens(hash_fn, None, (), (CONTEXT_TAG, *hashes[:j0]))
    for j in range(j0, len(hashes)):
        key = own[j - own_from] if j - own_from < len(own) else hashes[j]
        parent = hash_block_tokens(hash_fn, parent, tokens[j * bs : (j + 1) * bs], (CONTEXT_TAG, key))
        hashes[j] = parent  # in place: vLLM holds views of this list
    state.rekeyed_from = j0
    log.debug("request %s: span blocks from %d missed the cache; computed in context, not cached as spans",
             getattr(request, "request_id", "?"), j0)
    return len(hashes) - j0


def restore_span_keys(request: Any, hit_blocks: int = 0) -> None:
    """Undo `rekey_missed_spans` (in place): the request's span blocks hash as spans again, to be looked up anew.
    Not where the engine's own lookup (`hit_blocks` of it) already went past the first re-keyed block: the request
    then holds blocks computed in context there (looked up again after a preemption), and what it computes next
    must stay keyed as context too."""
    state = request_spans.get(request)
    if state is None or state.span_keys is None or hit_blocks > state.keys_from:
        return
    hashes = request.block_hashes
    hashes[state.keys_from : state.keys_from + len(state.span_keys)] = state.span_keys
    state.span_keys, state.rekeyed_from = None, None


# KV cache managers whose engine has a span tier: the tier's connector, asked right after every lookup, re-keys
# missed spans itself once it knows what it loads (`SpanTierConnector.get_num_new_matched_tokens`).
_REKEYED_BY_CONNECTOR: weakref.WeakSet[Any] = weakref.WeakSet()


def rekey_after_connector(kv_cache_manager: Any) -> None:
    """This manager's lookups leave re-keying to the engine's KV connector (called after each of them)."""
    _REKEYED_BY_CONNECTOR.add(kv_cache_manager)


# --------------------------------------------------------------------------------------------- CIDRA


# Copy plans kept at most: a plan lives from a request's lookup to its allocation in the same scheduling pass (a
# later lookup plans again), so only the plans of requests looked up and never admitted (aborted while waiting)
# grow past the requests one pass looks at; the oldest go first.
MAX_COW_PLANS = 4096


@dataclass
class ManagerSpans:
    """CIDRA's state beside one single-type KV cache manager (one engine core's full-attention blocks)."""

    planner: CidraPlanner
    # Request id -> its plan (hit-block indices that get a private copy, blocks moved in place), for a lookup
    # awaiting admission. Per manager: request ids are only unique within one engine.
    cow_plans: dict[str, StepPlan] = field(default_factory=dict)


# In-place moves of one cached block, in a KV cache below float32, before the prefix cache lets it go (each move
# rounds its keys once more: bf16 ~3e-3 relative a move); the next reader prepares it again.
MAX_MOVES_LOW_PRECISION = 8
WORN = {"blocks": 0}  # blocks dropped from the prefix cache so, in this process


def _manager_state(manager: Any) -> ManagerSpans:
    import torch

    pool = manager.block_pool
    dtype = getattr(getattr(manager, "kv_cache_spec", None), "dtype", torch.float32)
    max_moves = None if dtype in (torch.float32, torch.float64) else MAX_MOVES_LOW_PRECISION
    return ManagerSpans(CidraPlanner(manager.block_size, lambda b: pool.blocks[b].ref_cnt, max_moves=max_moves))


manager_spans: Extension[ManagerSpans] = Extension(
    "vllm.v1.core.single_type_kv_cache_manager.FullAttentionManager", _manager_state
)


def wrap_get_computed_blocks(orig: Any) -> Any:
    def get_computed_blocks(self: Any, request: Any) -> Any:
        result = orig(self, request)
        if self not in _REKEYED_BY_CONNECTOR:
            rekey_missed_spans(request, result[1])
        blocks, num_computed = result[0], result[1]
        if len(blocks.blocks) == 1:
            mgr = self.coordinator.single_type_managers[0]
            state = manager_spans(mgr)
            # A plan from an earlier lookup of this request (not admitted then) is stale: its hit may be gone.
            state.cow_plans.pop(request.request_id, None)
            hit = [blk.block_id for blk in blocks.blocks[0][: num_computed // mgr.block_size]]
            # A plan even without a local hit (an empty one): its first allocation then records the position of
            # every block it holds, those a KV connector (the span tier) loads included, which another request
            # must not rotate in place while this one reads them.
            state.cow_plans[request.request_id] = state.planner.plan(hit) if hit else StepPlan()
            while len(state.cow_plans) > MAX_COW_PLANS:  # lookups of requests never admitted (aborted waiting)
                del state.cow_plans[next(iter(state.cow_plans))]
        return result

    return get_computed_blocks


def forget_cow_plan(kv_cache_manager: Any, request_id: str) -> None:
    """Drop the copy plan of a lookup whose request is not admitted now (a span tier's "not yet"): the next lookup
    plans again, and a request aborted while it waits leaves nothing behind."""
    coordinator = getattr(kv_cache_manager, "coordinator", None)
    for mgr in getattr(coordinator, "single_type_managers", ()) or ():
        state = manager_spans.get(mgr)
        if state is not None:
            state.cow_plans.pop(request_id, None)


def wrap_get_num_blocks_to_allocate(orig: Any) -> Any:
    def get_num_blocks_to_allocate(self: Any, request_id: str, *args: Any, **kwargs: Any) -> int:
        n = orig(self, request_id, *args, **kwargs)
        if request_id not in self.num_cached_block:  # a first allocation: its duplicates need blocks too
            state = manager_spans.get(self)
            plan = state.cow_plans.get(request_id) if state is not None else None
            n += len(plan.duplicate) if plan is not None else 0
        return n

    return get_num_blocks_to_allocate


def wrap_allocate_new_blocks(orig: Any) -> Any:
    def allocate_new_blocks(self: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        state = manager_spans(self)
        req_blocks = self.req_to_blocks[request_id]
        plan = state.cow_plans.pop(request_id, None)
        duplicated = []
        for idx in plan.duplicate if plan is not None else ():
            copy = self.block_pool.get_new_blocks(1)[0]
            self._apply_cow(request_id, idx, req_blocks[idx], copy)  # copied before the forward pass
            duplicated.append(copy)
        state.planner.duplicates_made += len(duplicated)
        worn = state.planner.moved_in_place(plan.moved) if plan is not None else []
        # Positions to record: every block when a cache hit was just admitted, else only the blocks added now
        # (a running request's earlier blocks keep theirs: no per-step walk over every block it holds).
        first = 0 if plan is not None else len(req_blocks)
        # Blocks added since the lookup's hit (a KV connector's loads, added before this call) and now: anew.
        added = req_blocks[plan.hits :] if plan is not None else []
        new_blocks = orig(self, request_id, *args, **kwargs)
        state.planner.fresh([b.block_id for b in (*added, *new_blocks)])
        state.planner.admitted([b.block_id for b in req_blocks[first:]], first)
        if worn:  # moved too often in a low-precision cache: read by this request, then prepared again
            self.block_pool.evict_blocks(set(worn))
            WORN["blocks"] += len(worn)
        return duplicated + list(new_blocks)

    return allocate_new_blocks


# --------------------------------------------------------------------------------------------- pinned blocks

PIN_METHOD = "spanq_pin_blocks"  # EngineCore methods the plugin adds: a utility call reaches them from the server
UNPIN_METHOD = "spanq_unpin_blocks"
PINNED_METHOD = "spanq_pinned_blocks"


def _core_pins(core: Any) -> BlockPins | None:
    manager = core.scheduler.kv_cache_manager
    if len(manager.kv_cache_config.kv_cache_groups) != 1:
        return None  # (a model with several KV cache groups: no pins, as no cache probe)
    return BlockPins(manager.block_pool)


# One engine core's pinned blocks: taken by the embedded engine on its engine thread (`SpanEngine.compile(...,
# pin=True)`) and by `spanq serve` through utility calls (`POST /v1/spans`); both run between two steps.
engine_pins: Extension[BlockPins | None] = Extension("vllm.v1.engine.core.EngineCore", _core_pins)


def pin_blocks(self: Any, hashes: list[bytes]) -> dict[str, int]:
    """`EngineCore.spanq_pin_blocks(hashes)`: pin the cached blocks of these block hashes (`BlockPins.pin`)."""
    from vllm.v1.core.kv_cache_utils import BlockHash

    pins = engine_pins(self)
    if pins is None:
        return {"pinned": 0, "already": 0, "missing": 0, "refused": len(hashes)}
    return pins.pin([BlockHash(bytes(h)) for h in hashes])


def unpin_blocks(self: Any) -> int:
    """`EngineCore.spanq_unpin_blocks()`: drop every pin (the blocks stay cached, evictable again). How many."""
    pins = engine_pins.get(self)
    return pins.release() if pins is not None else 0


def pinned_blocks(self: Any) -> int:
    """`EngineCore.spanq_pinned_blocks()`: how many blocks are pinned now."""
    pins = engine_pins.get(self)
    return len(pins.held) if pins is not None else 0
