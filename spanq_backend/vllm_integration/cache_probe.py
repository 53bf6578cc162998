"""Is a span already in the engine's prefix cache? Then its prepare request can be skipped.

A prepare request for a cached span computes nothing, but still costs a round through the engine. Two ways to
know, both answering `cached(token_ids)` (True if `token_ids` is whole blocks, every one in the prefix cache):

- `BlockPoolProbe`: an in-process engine (`SpanEngine`) — vLLM's block pool, read from the caller's thread;
- `KVEventsMirror`: an engine core in another process (`spanq serve`) — a set of cached block hashes kept up
  to date from vLLM's KV cache events (ZMQ), which spanq serve turns on.

Either answer may be stale by the time the real request is scheduled (blocks are evicted concurrently, events
arrive after the step that caused them). A stale "cached" means the span's blocks miss, and the plugin's
isolation guard computes them in context: correct, only slower. A stale "not cached" costs the prepare request
that would have run anyway. Any error reads as "not cached".
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["BlockPins", "BlockPoolProbe", "KVEventsMirror", "block_hash_chain", "in_tier", "tier_holds_all", "tier_lost"]

log = logging.getLogger(__name__)


MEMO_BLOCKS = 65536  # block hashes a probe remembers (then it starts over)


def block_hash_chain(
    hash_fn: Callable[[Any], bytes],
    token_ids: list[int],
    block_size: int,
    root: Any = None,
    memo: dict[tuple[Any, tuple[int, ...]], Any] | None = None,
) -> Iterator[Any]:
    """vLLM's prefix-cache hash of each full block of a plain prompt (no LoRA, media or cache salt), in order.

    `root`: the hash chains start from (the engine's NONE_HASH); None uses this process's, which only a process
    that runs an engine core has set. `memo`: (parent hash, block tokens) -> hash, filled as it goes: every
    prepare prompt starts with the same anchor blocks and a warm query probes the same span blocks again, and a
    block's hash is a function of those two alone. The first block is always hashed (its parent is the root,
    which an engine started later in the process may seed anew), so every remembered key holds a real parent."""
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        known = memo.get((parent, block)) if memo is not None and start else None
        if known is None:
            known = hash_block_tokens(hash_fn, parent, block, None)
            if memo is not None and start:
                if len(memo) >= MEMO_BLOCKS:
                    memo.clear()
                memo[(parent, block)] = known
        parent = known
        yield parent


def in_tier(tier: Any, hashes: tuple[Any, ...] | None, cached: Callable[[Any], bool]) -> bool:
    """Whether a prompt of whole blocks (`hashes`) that the engine's cache does not hold wholly is, past the blocks
    it holds (`cached`), wholly in the engine's span tier: then its request loads them (the tier's connector looks
    up what follows the engine's own hit, contiguously)."""
    if tier is None or not hashes:
        return False
    local = True
    try:
        for h in hashes:
            if local and cached(h):
                continue
            local = False
            if not tier.holds(h):
                return False
    except Exception:  # noqa: BLE001  (the cache changed under us: read it as a miss)
        return False
    return not local


def tier_lost(tier: Any, hashes: tuple[Any, ...] | None, cached: Callable[[Any], bool]) -> bool:
    """Whether a block of a prompt of whole blocks (`hashes`) is neither in the engine's cache (`cached`) nor on the
    span tier's disk any more: a span a call loaded from the tier whose file was refused (corrupt, truncated) or
    evicted since. Nothing will load it again: it must be prepared."""
    if tier is None or not hashes:
        return False
    try:
        return any(not cached(h) and tier.gone(h) for h in hashes)
    except Exception:  # noqa: BLE001  (the cache changed under us: nothing said lost)
        return False


def tier_holds_all(tier: Any, hashes: tuple[Any, ...] | None) -> bool:
    """Whether the engine's span tier holds every whole block of a prompt (`hashes`)."""
    return tier is not None and bool(hashes) and all(tier.holds(h) for h in hashes)


class BlockPoolProbe:
    """Looks blocks up in an in-process engine's block pool (`cached_block_hash_to_block`)."""

    def __init__(self, pool: Any, hash_fn: Callable[[Any], bytes], block_size: int):
        self.pool, self.hash_fn, self.block_size = pool, hash_fn, block_size
        self._memo: dict[tuple[Any, tuple[int, ...]], Any] = {}
        self.tier: Any = None  # the engine's span tier (`spanq_backend/kv/tier.DiskTier`), if it has one

    @classmethod
    def of(cls, engine: Any, block_size: int) -> BlockPoolProbe | None:
        """The probe of an `LLMEngine` whose engine core runs in this process (else None: always prepare)."""
        try:
            core = engine.engine_core.engine_core  # InprocClient only
            manager = core.scheduler.kv_cache_manager
            groups = manager.kv_cache_config.kv_cache_groups
            hash_fn = core.request_block_hasher.hash_fn  # the plugin's `SpanBlockHasher`
        except AttributeError:
            return None
        if len(groups) != 1:
            return None
        return cls(manager.block_pool, hash_fn, block_size)

    def block_hashes(self, token_ids: list[int]) -> tuple[Any, ...] | None:
        """The prefix-cache hashes of a prompt of whole blocks (None for any other prompt: never cached)."""
        if not token_ids or len(token_ids) % self.block_size:
            return None
        return tuple(block_hash_chain(self.hash_fn, token_ids, self.block_size, memo=self._memo))

    def holds(self, hashes: tuple[Any, ...] | None) -> bool:
        """Whether the pool holds every block of `block_hashes`' answer."""
        if not hashes:
            return False
        try:
            return all(self.pool.get_cached_block(h, [0]) is not None for h in hashes)
        except Exception:  # noqa: BLE001  (the pool changed under us: read it as a miss)
            return False

    def cached(self, token_ids: list[int]) -> bool:
        return self.holds(self.block_hashes(token_ids))

    def tier_holds_all(self, token_ids: list[int]) -> bool:
        return tier_holds_all(self.tier, self.block_hashes(token_ids))

    def tier_keys(self, token_ids: list[int]) -> tuple[Any, ...] | None:
        """The names a span tier gives a prompt's blocks (`tier_holds_keys` asks for them): the pool's own hashes."""
        return self.block_hashes(token_ids)

    def tier_holds_keys(self, keys: tuple[Any, ...] | None) -> bool:
        return tier_holds_all(self.tier, keys)

    def in_tier(self, token_ids: list[int]) -> bool:
        return in_tier(self.tier, self.block_hashes(token_ids), lambda h: self.pool.get_cached_block(h, [0]) is not None)

    def tier_lost(self, token_ids: list[int]) -> bool:
        return tier_lost(self.tier, self.block_hashes(token_ids), lambda h: self.pool.get_cached_block(h, [0]) is not None)

    def cached_blocks(self, token_ids: list[int]) -> int:
        """How many leading whole blocks of a plain prompt the pool holds (what stock prefix caching would hit)."""
        whole = len(token_ids) // self.block_size * self.block_size
        held = 0
        try:
            for h in block_hash_chain(self.hash_fn, token_ids[:whole], self.block_size, memo=self._memo):
                if self.pool.get_cached_block(h, [0]) is None:
                    break
                held += 1
        except Exception:  # noqa: BLE001  (the pool changed under us: what was read so far)
            log.debug("block pool probe failed after %d blocks", held)
        return held


class BlockPins:
    """Blocks of an in-process engine's prefix cache held out of eviction (a pinned corpus): each holds a reference
    of its own, as a running request's would, and vLLM evicts only blocks no one references. Taken and dropped on
    the engine's thread, between steps (`SpanEngine.compile(..., pin=True)`, `SpanEngine.unpin`). At most
    `MAX_SHARE` of the cache's blocks are pinned, so that requests still find room to run."""

    MAX_SHARE = 0.5

    def __init__(self, pool: Any):
        self.pool = pool
        self.held: dict[Any, Any] = {}  # block hash -> the block this holds a reference on

    @property
    def limit(self) -> int:
        return int(self.pool.num_gpu_blocks * self.MAX_SHARE)

    def pin(self, hashes: list[Any]) -> dict[str, int]:
        """Pin the cached blocks of `hashes` (prefix-cache hashes, `BlockPoolProbe.block_hashes`): counts of
        those pinned now, already pinned, not in the cache (evicted before they could be pinned: nothing to hold)
        and refused (past the limit)."""
        counts = {"pinned": 0, "already": 0, "missing": 0, "refused": 0}
        for h in hashes:
            if h in self.held:
                counts["already"] += 1
                continue
            blocks = self.pool.get_cached_block(h, [0])
            if not blocks:
                counts["missing"] += 1
            elif len(self.held) >= self.limit:
                counts["refused"] += 1
            else:
                self.pool.touch(blocks)
                self.held[h] = blocks[0]
                counts["pinned"] += 1
        return counts

    def release(self) -> int:
        """Drop every pin: the blocks stay cached, evicted as any other from now on. How many."""
        blocks = list(self.held.values())
        self.held.clear()
        self.pool.free_blocks(blocks)
        return len(blocks)


class KVEventsMirror:
    """The block hashes an engine core holds in its prefix cache, followed through vLLM's ZMQ KV events.

    A background thread subscribes to the publisher's endpoint and applies `BlockStored`, `BlockRemoved` and
    `AllBlocksCleared`. Events are numbered: a gap (a dropped message, a publisher restart) or a message that
    does not decode clears the mirror, so it never claims a block it may have missed the removal of.
    """

    def __init__(self, endpoint: str, topic: str, hash_fn: Callable[[Any], bytes], block_size: int):
        from vllm.v1.core.kv_cache_utils import BlockHash, resolve_none_hash_seed

        self.endpoint, self.topic, self.hash_fn, self.block_size = endpoint, topic, hash_fn, block_size
        self.root = BlockHash(hash_fn(resolve_none_hash_seed(hash_fn)))  # the engine core's NONE_HASH
        self.tier: Any = None  # the engine's span tier as this process reads the folder, if it has one
        self._hashes: set[Any] = set()
        self._memo: dict[tuple[Any, tuple[int, ...]], Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.events = 0  # batches applied (for tests and logs)
        self.resets = 0  # times the mirror was cleared after a gap or a bad message
        self.last_seq: int | None = None  # number of the last batch received
        self._thread = threading.Thread(target=self._run, name="spanq-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=10)

    @classmethod
    def for_engine(cls, vllm_config: Any) -> KVEventsMirror | None:
        """A mirror of this engine's prefix cache, or None where its events cannot be followed here."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import _NON_CRYPTO_HASH_FUNCTIONS

        events = getattr(vllm_config, "kv_events_config", None)
        if events is None or not events.enable_kv_cache_events or events.publisher != "zmq":
            return None
        if not events.endpoint.startswith("ipc://"):
            return None  # only the endpoint spanq serve binds itself (a TCP "*" endpoint is the publisher's)
        cache = vllm_config.cache_config
        try:
            hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        except (KeyError, ValueError):
            return None
        if hash_fn in _NON_CRYPTO_HASH_FUNCTIONS and os.getenv("PYTHONHASHSEED") is None:
            return None  # the engine core seeds its chains at random: its hashes cannot be recomputed here
        return cls(events.endpoint, events.topic, hash_fn, cache.block_size)

    def _chain(self, token_ids: list[int]) -> tuple[Any, ...] | None:
        """The engine core's own block hashes (`BlockHash` bytes, what a span tier's files are named by) of a
        prompt of whole blocks; None for any other prompt, or where they cannot be computed."""
        if not token_ids or len(token_ids) % self.block_size:
            return None
        try:
            return tuple(block_hash_chain(self.hash_fn, token_ids, self.block_size, self.root, self._memo))
        except Exception:  # noqa: BLE001  (read as a miss: the prepare runs)
            return None

    def block_hashes(self, token_ids: list[int]) -> tuple[Any, ...] | None:
        """The hashes the events carry for a prompt of whole blocks (vLLM converts `BlockHash`es for its events:
        `maybe_convert_block_hash`); None for any other prompt, or where they cannot be computed: never cached."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        chain = self._chain(token_ids)
        return None if chain is None else tuple(maybe_convert_block_hash(h) for h in chain)

    def holds(self, hashes: tuple[Any, ...] | None) -> bool:
        """Whether the engine's cache holds every block of `block_hashes`' answer."""
        if not hashes:
            return False
        with self._lock:
            return all(h in self._hashes for h in hashes)

    def cached(self, token_ids: list[int]) -> bool:
        return self.holds(self.block_hashes(token_ids))

    # The tier is asked by the engine's own hashes (its files' names), the events' set by theirs.
    def in_tier(self, token_ids: list[int]) -> bool:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        return in_tier(self.tier, self._chain(token_ids), lambda h: maybe_convert_block_hash(h) in self._hashes)

    def tier_holds_all(self, token_ids: list[int]) -> bool:
        return tier_holds_all(self.tier, self._chain(token_ids))

    def tier_keys(self, token_ids: list[int]) -> tuple[Any, ...] | None:
        """The names a span tier gives a prompt's blocks: the engine core's hashes, not the events' (an int each)."""
        return self._chain(token_ids)

    def tier_holds_keys(self, keys: tuple[Any, ...] | None) -> bool:
        return tier_holds_all(self.tier, keys)

    def tier_lost(self, token_ids: list[int]) -> bool:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        return tier_lost(self.tier, self._chain(token_ids), lambda h: maybe_convert_block_hash(h) in self._hashes)

    def cached_blocks(self, token_ids: list[int]) -> int:
        """How many leading whole blocks of a plain prompt the engine's cache holds."""
        whole = len(token_ids) // self.block_size * self.block_size
        hashes = self.block_hashes(token_ids[:whole]) or ()
        held = 0
        with self._lock:
            for h in hashes:
                if h not in self._hashes:
                    break
                held += 1
        return held

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _apply(self, batch: Any) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        with self._lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._hashes.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self._hashes.difference_update(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    self._hashes.clear()
            self.events += 1

    def _reset(self, why: str) -> None:
        with self._lock:
            self._hashes.clear()
        self.resets += 1
        log.info("spanq: KV event mirror cleared (%s); spans are prepared until it refills", why)

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        context = zmq.Context.instance()
        sub = context.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.RCVTIMEO, 200)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            sub.connect(self.endpoint)
            self._ready.set()
            while not self._stop.is_set():
                try:
                    parts = sub.recv_multipart()
                except zmq.Again:
                    continue
                if len(parts) != 3:
                    continue
                seq = int.from_bytes(parts[1], "big", signed=True)
                last = self.last_seq
                if last is not None and seq != last + 1:
                    self._reset(f"event {seq} after {last}: some were missed, or the publisher restarted")
                self.last_seq = seq
                try:
                    self._apply(decoder.decode(parts[2]))
                except msgspec.DecodeError as e:
                    self._reset(f"an event batch did not decode: {e}")
        except Exception:  # the mirror is an optimization: log it, and answer "not cached" from now on
            log.exception("spanq: the KV event mirror stopped")
            with self._lock:
                self._hashes.clear()
            self._stop.set()
        finally:
            self._ready.set()
            sub.close()
