"""A disk tier for span KV: spans computed once outlive the engine, through vLLM's KV-connector interface.

What is stored: the blocks of spanq's *prepare* requests, `[anchor][span]` computed alone (and the prompt prefixes
prepared beside them) — the isolated KV that span reuse reads. One file per block, named by the block's vLLM
prefix-cache hash: a stock hash chain over the anchor's and the span's tokens, so the name says exactly which
tokens, after which tokens, the KV is of. Everything else that makes KV differ (the model's files, dtype, KV
cache dtype, block size, vLLM's version, this layout's version, the hash function and its seed, the CPU's
attention kernels) is folded into the *namespace*, a folder of its own: a tier written for another model or
setting is never read, it is simply not there.

How it is reached (`SpanTierConnector`, loaded by vLLM from `kv_connector_module_path`; no patch):

- scheduler side: a request whose next blocks (after what the engine's own cache holds) are in the tier, by
  their block hashes (a span query's span blocks by their span keys, the prepares' own), is told they are
  external hits, loaded asynchronously (vLLM holds the request until the load is done, so no other request reads
  the blocks before they hold data); its spans past them are re-keyed as context then. A request that would load
  a block another request is loading now waits a step and reads that one's copy from the cache. Prepare requests the
  generator marks (`TIER_PARAM` in `kv_transfer_params`) have their blocks saved once their prompt is computed;
- worker side: loads read each file's payload straight into the engine's blocks (one `preadv`), check the block's
  tokens (another content under the same key is refused) and a checksum over what was read, and tell spanq's
  block position tracker which position the keys encode (what the file records), so the next step moves them as
  any cached span's; saves copy a block's bytes out after the step's forward pass (the tracker says where its keys
  sit then) and write them from a thread: to a temporary name, then renamed, with a checksum over header and
  payload. A file that fails (truncated, corrupt, another block's) is moved aside and the request's blocks are
  computed instead.

vLLM's interface takes one count of external tokens per request: a tier block after a gap in what is cached is
not loaded by that request (the generator lays a query out so that its spans follow what is cached,
docs/design.md §10). One tier engine per process (vLLM keeps one connector per process).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import math
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

__all__ = [
    "LAYOUT_VERSION",
    "TIER_PARAM",
    "DiskTier",
    "SpanTierConnector",
    "TierError",
    "check_tier_dir",
    "gb_to_bytes",
    "namespace_of",
    "process_stats",
    "tier_for",
    "tier_params",
    "transfer_config",
]

log = logging.getLogger("spanq.tier")

LAYOUT_VERSION = 2  # the file format and what a block's bytes mean; a new version is a new namespace
TIER_PARAM = "spanq_tier"  # key in a request's kv_transfer_params: save this prepare request's blocks
MAGIC = b"SPQKVT02"
CHECKSUM_BYTES = 8  # xxHash's XXH3-64 of header and payload (~13 GB/s here, against torn or corrupt files)
CONNECTOR_NAME = "SpanTierConnector"
MODEL_SAMPLE_BYTES = 1 << 20  # of each weight file's start and end, in the model's digest


def tier_params() -> dict[str, Any]:
    """`SamplingParams.extra_args` of a prepare request whose blocks a tier engine saves."""
    return {"kv_transfer_params": {TIER_PARAM: True}}


class TierError(ValueError):
    """A tier that cannot be used as asked (a folder that cannot be written, another tier engine in the process)."""


# ------------------------------------------------------------------------------------------------ namespace

_MODEL_DIGESTS: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


def model_digest(path: str | Path) -> str:
    """A digest of a model folder's contents: its config and tokenizer files whole, each weight file's size and
    its first and last MiB (cached per process by the files' sizes and times)."""
    root = Path(path)
    if not root.is_dir():
        return hashlib.sha256(str(path).encode()).hexdigest()  # a hub id: its name is all that is known here
    files = sorted(p for p in root.iterdir() if p.is_file())
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    key = (str(root.resolve()), stamp)
    if key in _MODEL_DIGESTS:
        return _MODEL_DIGESTS[key]
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + str(p.stat().st_size).encode() + b"\0")
        with p.open("rb") as f:
            if p.suffix in (".json", ".txt", ".model", ".jinja"):
                h.update(f.read())
            else:
                h.update(f.read(MODEL_SAMPLE_BYTES))
                f.seek(max(0, p.stat().st_size - MODEL_SAMPLE_BYTES))
                h.update(f.read(MODEL_SAMPLE_BYTES))
    _MODEL_DIGESTS[key] = digest = h.hexdigest()
    return digest


def namespace_of(vllm_config: Any) -> tuple[str, dict[str, Any]]:
    """The namespace a tier engine reads and writes: `(digest, what it is made of)`. Every setting that changes
    the bytes of a block's KV for the same tokens is in it."""
    import vllm
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import _NON_CRYPTO_HASH_FUNCTIONS, resolve_none_hash_seed

    model, cache = vllm_config.model_config, vllm_config.cache_config
    hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
    if hash_fn in _NON_CRYPTO_HASH_FUNCTIONS and os.environ.get("PYTHONHASHSEED") is None:
        raise TierError(
            f"prefix_caching_hash_algo={cache.prefix_caching_hash_algo} seeds its hashes at random in each process, "
            "so a span tier's blocks would never be found again: use sha256 (vLLM's default) or set PYTHONHASHSEED"
        )
    hf = model.hf_config
    parts: dict[str, Any] = {
        "layout": LAYOUT_VERSION,
        "vllm": vllm.__version__,
        "model": model_digest(model.model),
        "hf_config": hashlib.sha256(hf.to_json_string(use_diff=False).encode()).hexdigest(),
        "dtype": str(model.dtype),
        "kv_cache_dtype": str(cache.cache_dtype),
        "block_size": int(cache.block_size),
        "hash": str(cache.prefix_caching_hash_algo),
        "hash_seed": resolve_none_hash_seed(hash_fn),  # as the engine core seeds its chains
        "device": str(vllm_config.device_config.device_type),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "amx": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()),
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]
    return digest, parts


# ------------------------------------------------------------------------------------------------ the store


@dataclass
class TierStats:
    loads: int = 0  # requests served from the tier
    loaded_blocks: int = 0
    saved_blocks: int = 0
    skipped_saves: int = 0  # blocks not saved: their keys were not at their prepare position
    failed_loads: int = 0  # files refused (checksum, header, read error): their requests computed instead
    failed_saves: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evicted_blocks: int = 0  # blocks removed to keep the tier under its capacity (least recently used first)
    load_seconds: float = 0.0  # time in the engine's step reading, checking and copying loaded blocks

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Block:
    """One stored block: the position its keys encode, the tokens it is the KV of, and each layer's name, shape,
    dtype and bytes (to write: the bytes; opened from a file: the byte count, the bytes staying in the file until
    `copy_into` reads them where they belong, or `DiskTier.read` reads them whole)."""

    position: int
    layers: list[tuple[str, tuple[int, ...], str, Any]] = field(default_factory=list)  # name, shape, dtype, bytes
    tokens: tuple[int, ...] = ()
    head: bytes = b""  # the file's bytes before the payload (what the checksum covers first)
    checksum: bytes = b""
    path: Path | None = None
    offset: int = 0  # where the payload starts in `path`
    pinned: bool = False  # to write: pinned once written (never evicted; `DiskTier.pin`)

    def copy_into(self, layers: EngineLayers, block_id: int, verified: Any,
                  tokens: tuple[int, ...] | None = None) -> None:
        """Read each layer's bytes from the file straight into block `block_id` of the engine's caches (one
        `preadv`: no copy of its own) and compute the checksum over what was read, while it is in the CPU's cache;
        `ValueError` where the block is not the one asked for (`tokens`: another content under the same key),
        does not fit the engine, or its checksum does not match (then what was read must not be used).
        `layers`: the engine's KV caches (`layer_arrays`)."""
        if tokens is not None and tuple(tokens) != self.tokens:
            raise ValueError("it holds the KV of other tokens under this key (a key collision): not served")
        if self.layers != layers.layout:  # names, shapes, dtypes and sizes, in order: one comparison
            raise ValueError(f"its layers are not the engine's: {_first_difference(self.layers, layers.layout)}")
        targets = [rows[block_id] for rows in layers.rows]
        checksum = bytearray(CHECKSUM_BYTES)
        assert self.path is not None
        fd = os.open(self.path, os.O_RDONLY)
        try:
            got = os.preadv(fd, [*targets, checksum], self.offset)
        finally:
            os.close(fd)
        if got != sum(t.nbytes for t in targets) + CHECKSUM_BYTES:
            raise ValueError("its payload is shorter than its header says (a truncated file)")
        digest = xxhash.xxh3_64(self.head)
        for t in targets:
            digest.update(t)
        if not verified(digest.intdigest(), checksum):
            raise ValueError("its checksum does not match (a corrupt or truncated file)")


@dataclass
class EngineLayers:
    """The engine's KV caches as a block file sees them: each layer's (name, shape, dtype, bytes) of one block, in
    order, and each layer's blocks as byte rows to read into (`layer_arrays`)."""

    layout: list[tuple[str, tuple[int, ...], str, int]]
    rows: list[Any]


def layer_arrays(kv_caches: list[tuple[str, torch.Tensor]]) -> EngineLayers:
    """The engine's KV caches as `Block.copy_into` reads into them: each layer's blocks as rows of bytes (a block's
    bytes in the order a block file holds them); `TierError` for a layout it cannot read into in place (a block
    whose bytes are not contiguous)."""
    layers = EngineLayers([], [])
    for name, cache in kv_caches:
        block = cache[0]
        if not block.is_contiguous() or cache.stride(0) != block.numel():
            raise TierError(f"layer {name}'s KV blocks are not contiguous in memory ({tuple(cache.shape)}, "
                            f"strides {cache.stride()}): the span tier cannot read into them")
        rows = cache.view(torch.uint8).numpy().reshape(cache.shape[0], -1)
        layers.layout.append((name, tuple(block.shape), str(cache.dtype), rows.shape[1]))
        layers.rows.append(rows)
    return layers


def _first_difference(stored: list[Any], engine: list[Any]) -> str:
    if len(stored) != len(engine):
        return f"it has {len(stored)} layers, the engine {len(engine)}"
    mine, theirs = next((a, b) for a, b in zip(stored, engine) if a != b)
    return f"its layer {mine[0]} {mine[1]} {mine[2]} is not the engine's {theirs[0]} {theirs[1]} {theirs[2]}"


def _key(block_hash: Any) -> bytes:
    """A block's hash as the bytes its file is named by; an int is refused (`bytes(n)` would be n zero bytes: an
    event's form of a hash, never a block's name)."""
    if isinstance(block_hash, int):
        raise TypeError("a span tier block is named by vLLM's BlockHash (bytes), not by an int (an event's hash)")
    return bytes(block_hash)


class DiskTier:
    """One namespace of a tier folder: `root/<namespace>/<hash[:2]>/<hash>.kv`, one file per block."""

    def __init__(self, root: str | Path, namespace: str, parts: dict[str, Any] | None = None,
                 max_bytes: int | None = None):
        if max_bytes is not None and not max_bytes > 0:
            raise TierError(f"a span tier's capacity must be a positive number of bytes, got {max_bytes!r}")
        self.root = Path(root)
        self.namespace = namespace
        self.max_bytes = max_bytes  # None: the tier grows until cleared
        self.dir = self.root / namespace
        check_tier_dir(self.dir)
        if parts is not None:
            self._describe(parts)
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._held: set[bytes] = set()
        self._readers: concurrent.futures.ThreadPoolExecutor | None = None
        self._ahead: dict[bytes, concurrent.futures.Future[Block]] = {}
        self._writes: queue.Queue[tuple[bytes, Block] | threading.Event] = queue.Queue()
        self._writing: set[bytes] = set()
        self._writer: threading.Thread | None = None
        self._said: set[str] = set()  # warnings given once (`_say_once`)
        self._pending_bytes = 0  # of the blocks waiting for the writer (`MAX_PENDING_BYTES`)
        # Blocks refused on load (`forget`): never offered again, even where their file could not be moved aside
        # (a read-only folder), until this process writes the block again.
        self._refused: set[bytes] = set()
        self._parts = parts
        self._identity: str | None = None  # (`identity`)
        self._bytes = 0  # of the blocks held, as last counted (`rescan`, `_evict`) plus what this process wrote
        self.rescan()

    # -- index

    def rescan(self) -> int:
        """Read which blocks the folder holds (another process may have written some); how many."""
        held: set[bytes] = set()
        total = 0
        for key, _, size in self._files():
            held.add(key)
            total += size
        with self._lock:
            self._held, self._bytes = held, total
        return len(held)

    def _describe(self, parts: dict[str, Any]) -> None:
        """`namespace.json`, what the namespace is made of (what `spanq tier` lists it by), written where it is
        missing or unreadable (damaged, or taken by a clear that raced a writer: its blocks would be unlisted)."""
        about = self.dir / "namespace.json"
        if not about.exists() or not _readable_json(about):
            _write_atomically(about, json.dumps(parts, indent=1, sort_keys=True).encode())

    def _files(self) -> list[tuple[bytes, os.stat_result, int]]:
        """Every block file the folder holds: (hash, its stat, its size); files removed meanwhile are left out."""
        found = []
        for sub in self.dir.iterdir() if self.dir.is_dir() else ():
            if sub.is_dir() and len(sub.name) == 2:
                for f in os.scandir(sub):
                    if f.name.endswith(".kv") and not f.name.startswith("."):
                        try:
                            key, st = bytes.fromhex(f.name[:-3]), f.stat()
                        except (ValueError, OSError):
                            continue
                        found.append((key, st, st.st_size))
        return found

    @property
    def bytes_held(self) -> int:
        return self._bytes

    @property
    def identity(self) -> str:
        """Which folder this is: the same for every process and machine that reads this folder (replicas on one
        shared disk pool what each knows it holds: `spanq_backend/cluster/policy.py`), another for a folder of the
        same path on another machine. A random id written once into the namespace (`tier-id`, created whole or not
        at all, the first writer's kept); where it can be neither read nor written, the host and the path."""
        if self._identity is None:
            path = self.dir / "tier-id"
            try:
                if not path.exists():
                    tmp = path.with_name(f".tier-id.{os.getpid()}.{threading.get_ident()}.tmp")
                    tmp.write_text(os.urandom(12).hex())
                    try:
                        os.link(tmp, path)  # fails where another process made it first: theirs is kept
                    except FileExistsError:
                        pass
                    finally:
                        tmp.unlink(missing_ok=True)
                self._identity = path.read_text().strip()
            except OSError:
                self._identity = f"{socket.gethostname()}:{self.dir.resolve()}"
        return self._identity

    # -- pins and capacity

    def pin(self, hashes: list[Any]) -> int:
        """Pin blocks the folder holds: never evicted to make room (a marker file beside each, `<hash>.pin`, seen
        by every process on the folder). How many were pinned."""
        n = 0
        for h in hashes:
            path = self.path_of(h)
            try:
                if path.exists():
                    path.with_suffix(".pin").touch()
                    n += 1
            except OSError as e:  # a folder gone read-only, say: the block stays, unpinned; serving goes on
                self._say_once("pin", f"span tier: blocks cannot be pinned in {self.dir} ({e}); they stay unpinned")
        return n

    def _say_once(self, what: str, message: str) -> None:
        if what not in self._said:
            self._said.add(what)
            log.warning("%s", message)

    def used(self, block_hash: Any) -> None:
        """A block was just loaded: its file's modification time says so (what eviction orders by, least recently
        used first, whichever process used it)."""
        with contextlib.suppress(OSError):
            os.utime(self.path_of(block_hash))

    def used_later(self, hashes: list[bytes]) -> None:
        """`used` for these blocks, on the tier's reader threads: bookkeeping for eviction, kept out of the engine's
        step (a system call a block)."""
        if hashes:
            self._pool().submit(lambda: [self.used(h) for h in hashes])

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._readers is None:
                self._readers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="spanq-tier-read")
            return self._readers

    def _evict(self) -> None:
        """Past the capacity: remove the least recently used unpinned blocks (written or last loaded longest ago)
        until the folder holds at most 90% of it. Counted on the folder itself (other processes write to it)."""
        assert self.max_bytes is not None
        files = self._files()
        total = sum(size for *_, size in files)
        if total > self.max_bytes:
            target = int(self.max_bytes * 0.9)
            for key, st, size in sorted(files, key=lambda f: (f[1].st_mtime_ns, f[0])):
                if total <= target:
                    break
                if key in self._ahead:  # read ahead: a load of it is planned (its file must be there to read)
                    continue
                path = self.path_of(key)
                try:
                    if path.with_suffix(".pin").exists():
                        continue
                    path.unlink()
                    self.stats.evicted_blocks += 1
                except FileNotFoundError:
                    pass  # removed meanwhile (another process's eviction)
                except OSError as e:  # this one cannot be removed: the next, so that the capacity still holds
                    self._say_once("evict", f"span tier: blocks cannot be removed from {self.dir} ({e}); the "
                                   "next least recently used go instead")
                    continue
                with self._lock:
                    self._held.discard(key)
                total -= size
        with self._lock:
            self._bytes = total

    def holds(self, block_hash: Any) -> bool:
        """Whether the folder holds the block: the index, else the disk (another process, a replica or `spanq
        prepare`, may have written it since the folder was read)."""
        key = _key(block_hash)
        if key in self._refused:
            return False
        if key in self._held:
            return True
        try:
            found = self.path_of(key).exists()
        except OSError:  # a folder this process may not read: as if absent (the span is computed)
            return False
        if found:
            with self._lock:
                self._held.add(key)
        return found

    def gone(self, block_hash: Any) -> bool:
        """Whether the block's file is not on the disk now, whatever the index says (an engine refused it and moved
        it aside, or it was evicted, maybe by another process); the index forgets it then."""
        key = _key(block_hash)
        with contextlib.suppress(OSError):
            if key in self._writing or self.path_of(key).exists():
                return False
        with self._lock:
            self._held.discard(key)
        return True

    def __len__(self) -> int:
        return len(self._held)

    def path_of(self, block_hash: Any) -> Path:
        name = _key(block_hash).hex()
        return self.dir / name[:2] / f"{name}.kv"

    # -- reading

    HEAD_READ = 8192  # bytes read first: the magic, the header's length and (for any model here) the header

    def open_block(self, block_hash: Any, ahead: bool = False) -> Block:
        """The stored block's header, read and checked (that it is the block asked for, that the file is the size
        it says); its payload stays in the file (`Block.copy_into`, `read`). `ahead`: ask the OS to read the
        payload into its page cache meanwhile. Raises `ValueError` (or `OSError`) for anything else."""
        path = self.path_of(block_hash)
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            first = os.pread(fd, self.HEAD_READ, 0)
            if len(first) < len(MAGIC) + 4 or first[: len(MAGIC)] != MAGIC:
                raise ValueError("not a span tier block (truncated, or another format)")
            (header_len,) = struct.unpack_from("<I", first, len(MAGIC))
            offset = len(MAGIC) + 4 + header_len
            if offset + CHECKSUM_BYTES > size:  # never read past the file for a corrupt length
                raise ValueError("its header is longer than the file (a corrupt or truncated file)")
            head = first[:offset] if offset <= len(first) else first + os.pread(fd, offset - len(first), len(first))
            if ahead and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, offset, 0, os.POSIX_FADV_WILLNEED)  # from disk while the step runs
        finally:
            os.close(fd)
        try:
            header = json.loads(head[len(MAGIC) + 4 :])
            if not isinstance(header, dict):
                raise TypeError("not an object")
            if header.get("namespace") != self.namespace or header.get("hash") != _key(block_hash).hex():
                raise LookupError("it holds another block (its header names another hash or namespace)")
            block = Block(int(header["position"]), tokens=tuple(int(t) for t in header.get("tokens", ())),
                          head=head, path=path, offset=offset)
            for name, shape, dtype, nbytes in header["layers"]:
                block.layers.append((str(name), tuple(int(n) for n in shape), str(dtype), int(nbytes)))
        except LookupError as e:  # (KeyError, IndexError: a field missing)
            raise ValueError(str(e) if not isinstance(e, (KeyError, IndexError)) else
                             f"its header lacks {e} (a corrupt file)") from None
        except (ValueError, TypeError, AttributeError) as e:  # JSON that is not a block header
            raise ValueError(f"its header does not read ({e}: a corrupt or truncated file)") from None
        if offset + sum(n for *_, n in block.layers) + CHECKSUM_BYTES != size:
            raise ValueError("its payload is not the size its header says (a truncated file)")
        self.stats.bytes_read += size
        return block

    def read(self, block_hash: Any) -> Block:
        """The stored block with its layers' bytes, its checksum checked (`open_block`, then a read of the rest)."""
        block = self.open_block(block_hash)
        assert block.path is not None
        with block.path.open("rb") as f:
            f.seek(block.offset)
            payload = f.read()
        data = memoryview(payload)
        block.checksum = bytes(data[-CHECKSUM_BYTES:])
        if not self._verified(xxhash.xxh3_64_intdigest(block.head + payload[:-CHECKSUM_BYTES]), block.checksum):
            raise ValueError("its checksum does not match (a corrupt or truncated file)")
        at, layers = 0, []
        for name, shape, dtype, nbytes in block.layers:
            layers.append((name, shape, dtype, data[at : at + nbytes]))
            at += nbytes
        block.layers = layers
        return block

    @staticmethod
    def _verified(digest: int, checksum: Any) -> bool:
        return digest.to_bytes(CHECKSUM_BYTES, "little") == bytes(checksum)

    # -- reading ahead (an engine's scheduler knows which blocks it loads a step before its worker copies them)

    PREFETCH_LIMIT = 4096  # blocks read ahead and not taken (an aborted request's) before the oldest are dropped

    def prefetch(self, hashes: list[bytes]) -> None:
        """Start reading these blocks on the tier's reader threads; `take` gets them."""
        readers = self._pool()
        with self._lock:
            for h in hashes:
                if h not in self._ahead:
                    self._ahead[h] = readers.submit(self._warm, h)
            while len(self._ahead) > self.PREFETCH_LIMIT:
                self._ahead.pop(next(iter(self._ahead))).cancel()

    def _warm(self, block_hash: Any) -> Block:
        return self.open_block(block_hash, ahead=True)

    def take(self, block_hash: Any) -> Block:
        """The block, opened ahead by `prefetch` or now (`open_block`); raises as it does."""
        key = _key(block_hash)
        with self._lock:
            ahead = self._ahead.pop(key, None)
        if ahead is not None and not ahead.cancelled():
            return ahead.result()
        return self.open_block(key)

    def refuse(self, block_hash: Any) -> None:
        """Never offer the block again from this index (its loads keep failing), until a good copy is written."""
        key = _key(block_hash)
        with self._lock:
            self._held.discard(key)
            self._refused.add(key)

    def forget(self, block_hash: Any, why: str, then: str = "not loaded ({why}); it is computed instead") -> None:
        """A block that failed to load (or a check): out of the index, its file moved aside (kept for a look, never
        read); `then` is what the log line says of it."""
        key = _key(block_hash)
        with self._lock:
            self._held.discard(key)
            self._refused.add(key)
        path = self.path_of(key)
        try:
            path.replace(path.with_suffix(".bad"))
        except FileNotFoundError:
            if not self.dir.is_dir():  # the tier was cleared (`spanq tier --clear`) under a running engine
                self.rescan()
        except OSError:
            pass
        log.warning("span tier: block %s… %s", key.hex()[:12], then.format(why=why))

    # -- writing

    # Bytes of blocks waiting for the writer: past it, a block is not saved (counted as a failed save, said once)
    # — an engine computes KV faster than a slow disk takes it, and each waiting block is a copy in memory.
    MAX_PENDING_BYTES = 2 << 30

    def write_later(self, block_hash: Any, block: Block) -> None:
        """Write a block from the writer thread (its bytes are already copied out of the engine)."""
        key = _key(block_hash)
        size = sum(len(data) for *_, data in block.layers)
        with self._lock:
            if key in self._held or key in self._writing:
                return
            if self._pending_bytes + size > self.MAX_PENDING_BYTES:
                self.stats.failed_saves += 1
                self._say_once("backlog", f"span tier: more than {self.MAX_PENDING_BYTES >> 20} MiB of blocks wait "
                               f"to be written to {self.dir}; blocks past that are not saved (computed when needed)")
                return
            self._pending_bytes += size
            self._writing.add(key)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="spanq-tier-writer", daemon=True)
                self._writer.start()
        self._writes.put((key, block))

    def flush(self, timeout: float | None = 120.0) -> bool:
        """Wait until every block handed to `write_later` is on disk (or failed); False where `timeout` came
        first (said in the log: those blocks are not written if the process ends now)."""
        if self._writer is None:
            return True
        done = threading.Event()
        self._writes.put(done)  # type: ignore[arg-type]
        if done.wait(timeout):
            return True
        log.warning("span tier: %d blocks still wait to be written to %s after %.0f s", len(self._writing), self.dir,
                    timeout or 0)
        return False

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            key, block = item
            try:
                size = self._write(key, block)
                if block.pinned:
                    self.path_of(key).with_suffix(".pin").touch()
                with self._lock:
                    self._held.add(key)
                    self._refused.discard(key)  # a good copy again
                    self._bytes += size
                self.stats.saved_blocks += 1
                if self.max_bytes is not None and self._bytes > self.max_bytes:
                    self._evict()
            except Exception as e:  # noqa: BLE001 - a full or read-only disk (or anything else): computing stays
                # correct, say it once; the writer goes on (a flush waiting on it must end)
                self.stats.failed_saves += 1
                self._say_once("write", f"span tier: blocks cannot be written to {self.dir} ({e}); spans are "
                               "computed as without a tier until it can")
            finally:
                with self._lock:
                    self._writing.discard(key)
                    self._pending_bytes -= sum(len(data) for *_, data in block.layers)

    def _write(self, key: bytes, block: Block) -> int:
        header = json.dumps({
            "namespace": self.namespace,
            "hash": key.hex(),
            "position": block.position,
            "tokens": list(block.tokens),
            "layers": [[name, list(shape), dtype, len(data)] for name, shape, dtype, data in block.layers],
        }).encode()
        header += b" " * (-(len(MAGIC) + 4 + len(header)) % 64)  # the payload starts aligned (JSON ignores the spaces)
        body = b"".join([MAGIC, struct.pack("<I", len(header)), header, *(data for *_, data in block.layers)])
        payload = body + xxhash.xxh3_64_intdigest(body).to_bytes(CHECKSUM_BYTES, "little")
        path = self.path_of(key)
        if not path.parent.is_dir():
            if not self.dir.is_dir():  # cleared under a running engine (`spanq tier --clear`): made again
                self.dir.mkdir(parents=True, exist_ok=True)
                self.rescan()
            path.parent.mkdir(exist_ok=True)
        if self._parts is not None and not (self.dir / "namespace.json").exists():
            self._describe(self._parts)  # (a clear that raced this writer took it and left blocks: else unlisted)
        _write_atomically(path, payload)
        self.stats.bytes_written += len(payload)
        return len(payload)


def _readable_json(path: Path) -> bool:
    try:
        json.loads(path.read_bytes())
        return True
    except (OSError, ValueError):
        return False


def _write_atomically(path: Path, data: bytes) -> None:
    """Whole or absent: written under a name of its own, then renamed (concurrent writers of one block leave
    one good copy: the last rename wins, and each is whole)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def gb_to_bytes(gb: float | None) -> int | None:
    """A capacity given in GB (10^9 bytes: `--tier-max-gb`) in bytes; None stays None."""
    if gb is None:
        return None
    if not (gb > 0 and math.isfinite(gb)):  # (inf and nan: not sizes; int() of them raised OverflowError)
        raise TierError(f"a span tier's capacity (--tier-max-gb) must be a finite number of GB above 0, got {gb}")
    return int(gb * 1e9)


def check_tier_dir(path: str | Path) -> None:
    """Make the folder if need be and check it can be written: `TierError` naming it, before an engine starts."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise TierError(f"the span tier folder {folder} is a file, not a folder: give a folder (made if need be)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-check-{os.getpid()}-{threading.get_ident()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise TierError(f"the span tier folder {folder} cannot be written: {e}") from e


_TIERS: dict[tuple[str, str], DiskTier] = {}
_TIERS_LOCK = threading.Lock()


def tier_for(root: str | Path, vllm_config: Any, starting: bool = False, max_bytes: int | None = None) -> DiskTier:
    """This process's `DiskTier` of `root` for an engine's config (the scheduler and the worker of an engine in
    one process share it, and with it the index of what is held). `starting`: an engine starts on it (its
    scheduler's connector): the folder is read again and the counters start over. `max_bytes`: its capacity
    (an engine starting on it sets it; None: none)."""
    namespace, parts = namespace_of(vllm_config)
    # what `spanq tier` names the model by (not in the digest: the same model under another folder name is the same)
    model = str(vllm_config.model_config.model)
    about = {**parts, "model_name": Path(model).name if Path(model).is_dir() else model}
    key = (str(Path(root).resolve()), namespace)
    with _TIERS_LOCK:
        tier = _TIERS.get(key)
        if tier is None:
            tier = _TIERS[key] = DiskTier(root, namespace, about, max_bytes)
        elif starting:
            tier.max_bytes = max_bytes
            tier.flush()
            tier.rescan()
            tier.stats = TierStats()
        return tier


TIER_COUNTERS = ("loaded_blocks", "saved_blocks", "failed_loads", "failed_saves", "evicted_blocks", "bytes_read",
                 "bytes_written")


def process_stats() -> dict[str, float]:
    """The counters of this process's span tiers, summed, as `tier_<name>`; the blocks they hold as `tier_blocks`.
    Empty where no engine of this process has a tier (its counters are then absent, not zero)."""
    with _TIERS_LOCK:
        tiers = list(_TIERS.values())
    if not tiers:
        return {}
    out: dict[str, float] = {f"tier_{name}": float(sum(getattr(t.stats, name) for t in tiers)) for name in TIER_COUNTERS}
    out["tier_blocks"] = float(sum(len(t) for t in tiers))
    return out


def transfer_config(tier_dir: str | Path, max_bytes: int | None = None, pin: bool = False) -> Any:
    """vLLM's `KVTransferConfig` for an engine with the span tier in `tier_dir` (`max_bytes`: its capacity, the
    least recently used unpinned blocks evicted past it; `pin`: every block this engine saves is pinned, what
    `spanq prepare --pin` asks). Refused (`TierError`) off vLLM's CPU backend: the tier copies blocks through host
    memory and is checked only there."""
    if max_bytes is not None and not max_bytes > 0:
        raise TierError(f"a span tier's capacity must be a positive number of bytes, got {max_bytes!r}")
    from vllm.config import KVTransferConfig
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise TierError(
            f"the span tier runs on vLLM's CPU backend only for now (this is {current_platform.device_type}): its "
            "loads and saves are not checked on a GPU, so it is refused rather than risk wrong KV"
        )

    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path=__name__,
        kv_role="kv_both",
        # a block that fails to load: the request starts over, and the block is no longer in the tier's index
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"tier_dir": str(tier_dir),
                                   **({"max_bytes": int(max_bytes)} if max_bytes is not None else {}),
                                   **({"pin": True} if pin else {})},
    )


# ------------------------------------------------------------------------------------------------ connector

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
    )
except ImportError:  # pragma: no cover - the backend extra is not installed: no connector to define
    KVConnectorBase_V1 = object  # type: ignore[assignment,misc]
    KVConnectorMetadata = object  # type: ignore[assignment,misc]


@dataclass
class TierMetadata(KVConnectorMetadata):  # type: ignore[misc]
    # request id -> [(block hash, block id, the block's tokens)] to load
    loads: dict[str, list[tuple[bytes, int, tuple[int, ...]]]] = field(default_factory=dict)
    # (block hash, block id, logical index, the block's tokens) to save after this step's forward pass
    saves: list[tuple[bytes, int, int, tuple[int, ...]]] = field(default_factory=list)


class SpanTierConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """spanq's span tier, as vLLM's KV connector (both roles; see the module's docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        root = self._kv_transfer_config.kv_connector_extra_config.get("tier_dir")
        if not root:
            raise TierError("the span tier connector needs kv_connector_extra_config['tier_dir']")
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.tier = tier_for(root, vllm_config, starting=role == KVConnectorRole.SCHEDULER,
                             max_bytes=extra.get("max_bytes"))
        self.pin_saves = bool(extra.get("pin"))
        self.block_size = int(vllm_config.cache_config.block_size)
        # scheduler side
        self._lookups: dict[str, tuple[int, list[bytes]]] = {}
        self._loads: dict[str, list[tuple[bytes, int, tuple[int, ...]]]] = {}
        self._marked: dict[str, Any] = {}
        # blocks being loaded, by the request loading them (until its load is reported done): a request that
        # would load one of them too waits for it and finds it in the engine's cache instead (`in_flight_by`)
        self._in_flight: dict[bytes, str] = {}
        self._loading: dict[str, list[bytes]] = {}
        self.deferred_lookups = 0  # lookups answered "not yet" for that reason
        # blocks of failed loads whose file is still there, by how many loads of them failed (`_load_failed`)
        self._failures: dict[bytes, int] = {}
        # worker side
        self._arrays = EngineLayers([], [])  # the engine's KV caches, as byte rows (`layer_arrays`)
        self._received: set[str] = set()
        self._failed: set[str] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a later miss

    # ---------------------------------------------------------------------------------------- scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        from spanq_backend.vllm_integration.engine_core import rekey_after_connector

        super().bind_kv_cache_manager(kv_cache_manager)
        rekey_after_connector(kv_cache_manager)  # span blocks past the local hit are looked up here first

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """What follows the engine's own hit in the tier, contiguously: a prepare's anchor and span blocks, a span
        query's prefix and span blocks (their span keys are the prepares' own: invariant 3). A span query's spans
        past what is found are then re-keyed as context (invariant 1), as the engine's lookup does without a tier."""
        from spanq_backend.vllm_integration.engine_core import (
            forget_cow_plan,
            rekey_missed_spans,
            restore_span_keys,
            span_table_of,
        )

        table = span_table_of(request)
        bs = self.block_size
        start = num_computed_tokens // bs
        if table is not None:
            restore_span_keys(request, start)  # an earlier lookup of this request re-keyed them
        hashes = request.block_hashes
        limit = min(len(hashes), (request.num_prompt_tokens - 1) // bs)  # vLLM computes at least one token
        found: list[bytes] = []
        if not getattr(request, "skip_reading_prefix_cache", False):
            for j in range(start, limit):
                if not self.tier.holds(hashes[j]):
                    break
                found.append(bytes(hashes[j]))
        if self.in_flight_by(found, request.request_id):
            self.deferred_lookups += 1
            if self._kv_cache_manager is not None:
                forget_cow_plan(self._kv_cache_manager, request.request_id)
            return None, False  # vLLM asks again at a later step, when the other load is cached
        if table is not None:
            rekey_missed_spans(request, (start + len(found)) * bs, keep_span_keys=True)
        if not found:
            return 0, False
        self._lookups[request.request_id] = (start, found)
        return len(found) * bs, True

    def in_flight_by(self, found: list[bytes], rid: str) -> str | None:
        """Another request that is loading one of these blocks now. Requests scheduled together that share a
        prefix held by the tier (prepares after one anchor, a compile's batch) would each load it into blocks of
        their own — vLLM caches loaded blocks only once their load is done — so all but the first wait a step and
        read the first's copy from the engine's cache."""
        for h in found:
            other = self._in_flight.get(h)
            if other is not None and other != rid:
                return other
        return None

    def _load_done(self, rid: str) -> None:
        for h in self._loading.pop(rid, ()):
            if self._in_flight.get(h) == rid:
                del self._in_flight[h]

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        failed = set(getattr(connector_output, "failed_recving", None) or ())  # (also in finished_recving)
        for rid in failed:
            self._load_failed(rid)
            self._load_done(rid)
        for rid in (connector_output.finished_recving or ()):
            if rid not in failed and self._failures:
                for h in self._loading.get(rid, ()):  # loaded well: no failure of another load counts against it
                    self._failures.pop(h, None)
            self._load_done(rid)  # vLLM caches its blocks when it schedules the request next, before others

    MAX_LOAD_FAILURES = 2  # failed loads of a block whose file stays (it could not be moved aside) before it is refused

    def _load_failed(self, rid: str) -> None:
        """A request's load failed in the worker, which refused a block: moved its file aside and struck it from
        its own index. Where the worker runs in another process (vLLM's default engine mode), this index still
        holds it and would offer it to the request's next lookup, and to every lookup after, each load failing
        again: the query would never answer. So the blocks of the failed load whose file is gone are forgotten
        here too (`gone`), and one whose file stays (it could not be moved: a read-only folder) is refused after
        `MAX_LOAD_FAILURES` failed loads. A forgotten block is found again once a good copy is written (`holds`
        reads the disk)."""
        for h in self._loading.get(rid, ()):
            if self.tier.gone(h):
                self._failures.pop(h, None)
                continue
            self._failures[h] = self._failures.get(h, 0) + 1
            if self._failures[h] >= self.MAX_LOAD_FAILURES:
                del self._failures[h]
                self.tier.refuse(h)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        params = request.kv_transfer_params or {}
        if params.get(TIER_PARAM):
            self._marked[rid] = request
        if not num_external_tokens:
            self._lookups.pop(rid, None)
            return
        lookup = self._lookups.pop(rid, None)
        if lookup is None:  # never expected: the load is reported failed, and the request looked up again
            log.warning("span tier: no lookup of request %s to load; it is computed instead", rid)
            self._loads[rid] = []
            return
        start, found = lookup
        ids, bs, tokens = blocks.get_block_ids()[0], self.block_size, request.all_token_ids
        self._loads[rid] = [(h, int(ids[j]), tuple(tokens[j * bs : (j + 1) * bs]))
                            for j, h in enumerate(found, start)]
        self._loading[rid] = found
        for h in found:
            self._in_flight.setdefault(h, rid)
        self.tier.prefetch(found)  # read while this step runs; the worker copies them in after its forward pass

    def build_connector_meta(self, scheduler_output: Any) -> TierMetadata:
        meta = TierMetadata(loads=self._loads)
        self._loads = {}
        scheduled = scheduler_output.num_scheduled_tokens
        for rid, request in list(self._marked.items()):
            n = scheduled.get(rid, 0)
            if not n or request.num_computed_tokens + n < request.num_prompt_tokens:
                continue  # not scheduled this step, or its prompt not done by it (chunked)
            del self._marked[rid]
            ids = self._kv_cache_manager.get_block_ids(rid)[0] if self._kv_cache_manager is not None else []
            whole = min(len(ids), request.num_prompt_tokens // self.block_size, len(request.block_hashes))
            for j in range(whole):
                h = bytes(request.block_hashes[j])
                if self.tier.holds(h):
                    if self.pin_saves:
                        self.tier.pin([h])  # written by another engine or an earlier run: pinned all the same
                else:
                    bs = self.block_size
                    meta.saves.append((h, int(ids[j]), j, tuple(request.all_token_ids[j * bs : (j + 1) * bs])))
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._marked.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._load_done(request.request_id)
        return False, None

    # ------------------------------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        off_cpu = [name for name, t in kv_caches.items() if t.device.type != "cpu"]
        if off_cpu:  # `transfer_config` refuses such engines; one built another way is refused here
            raise TierError(f"the span tier copies KV through host memory; layer {off_cpu[0]} is on {kv_caches[off_cpu[0]].device}")
        self._arrays = layer_arrays(list(kv_caches.items()))

    def _tracker(self) -> Any:
        from spanq_backend.vllm_integration.worker import stepping_runtime

        rt = stepping_runtime()
        return None if rt is None else rt.tracker

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, TierMetadata) or not meta.loads:
            return
        tracker = self._tracker()
        started = time.perf_counter()
        refused: set[bytes] = set()  # files refused this step: another request of the step that reads one fails too
        loaded: list[bytes] = []
        for rid, items in meta.loads.items():
            self._received.add(rid)
            if not items:
                self._failed.add(rid)
                continue
            for h, block_id, tokens in items:
                if bytes(h) in refused:  # looked up before the file was refused (and moved aside): computed too
                    self._failed.add(rid)
                    break
                try:
                    stored = self.tier.take(h)
                    stored.copy_into(self._arrays, block_id, self.tier._verified, tokens)
                except Exception as e:  # noqa: BLE001 - whatever a file makes a load raise: that request computes
                    # the span instead; the engine's step goes on (an error escaping here would end the engine)
                    self.tier.stats.failed_loads += 1
                    self.tier.forget(h, str(e))
                    refused.add(bytes(h))
                    self._failed.add(rid)
                    break
                if tracker is not None:
                    tracker.loaded(block_id, stored.position)
                loaded.append(h)
            else:
                self.tier.stats.loads += 1
                self.tier.stats.loaded_blocks += len(items)
        self.tier.stats.load_seconds += time.perf_counter() - started
        self.tier.used_later(loaded)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are copied out after the forward pass (`wait_for_save`)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, TierMetadata) or not meta.saves:
            return
        tracker = self._tracker()
        for h, block_id, j, tokens in meta.saves:
            position = None if tracker is None else tracker.position_of(block_id)
            if position != j * self.block_size:  # keys not where the prepare computed them: not stored
                self.tier.stats.skipped_saves += 1
                continue
            layers = [(name, shape, dtype, rows[block_id].tobytes())
                      for (name, shape, dtype, _), rows in zip(self._arrays.layout, self._arrays.rows)]
            self.tier.write_later(h, Block(position, layers, tokens, pinned=self.pin_saves))

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        received, failed = self._received, self._failed
        self._received, self._failed = set(), set()
        return KVConnectorTransferResults(finished_recving=received, failed_recving=failed)

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self.tier.flush()
