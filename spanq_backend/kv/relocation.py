"""Where each cached block's keys sit, and moving them: the runner-side half of span reuse.

`BlockPositionTracker` follows the scheduler's output step by step: a block computed at logical block j of a
request encodes position `j * block_size`; a prefix-cache hit of that block at another logical index needs
its keys re-rotated by the difference before the forward pass. `KVRelocator` applies those moves to the KV
cache tensors in place (K only; V does not depend on position). Both are plain Python/torch, testable
without vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import NamedTuple

import numpy as np
import torch

from spanq_backend.kv.rerope import RelocationError, RopeSpec

__all__ = ["BlockPositionTracker", "KLayout", "KVRelocator", "Move"]


class Move(NamedTuple):
    """Rotate the keys of block `block_id` by `delta` positions (a tuple: the runner makes thousands per step)."""

    block_id: int
    delta: int  # positions to add to the block's keys


_new_move = partial(tuple.__new__, Move)  # Move from a (block_id, delta) pair, without a Python-level __new__


class BlockPositionTracker:
    """Which position each cached block's keys encode, and how many running requests read it.

    Per-block state lives in arrays indexed by block id (vLLM's block ids are small dense integers), so placing
    a request costs a few vectorized operations, not a dictionary update per block: the runner does this for
    every admitted request of every step. Arrays grow on demand when `num_blocks` is not given.
    """

    def __init__(self, block_size: int, num_blocks: int = 0):
        self.block_size = block_size
        size = max(1, num_blocks)
        self._pos = np.full(size, -1, dtype=np.int64)  # position of the block's first key; -1: never computed
        self._readers = np.zeros(size, dtype=np.int64)  # running requests holding the block
        self._stamp = np.zeros(size, dtype=np.int64)  # scratch: finds a block listed twice in one placement
        self._starts = np.zeros(0, dtype=np.int64)  # j * block_size for j = 0, 1, ...
        self._blocks: dict[str, np.ndarray] = {}  # request -> its blocks, in logical order
        self.conflicts = 0  # moves of a block another running request reads (at another position)

    def position_of(self, block_id: int) -> int | None:
        """Position of the block's first key, or None if no request ever computed it."""
        p = int(self._pos[block_id]) if block_id < len(self._pos) else -1
        return None if p < 0 else p

    def readers(self, block_id: int) -> int:
        """How many running requests read this block."""
        return int(self._readers[block_id]) if block_id < len(self._readers) else 0

    def _ids(self, block_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if len(ids) and int(ids.max()) >= len(self._pos):
            grow = max(int(ids.max()) + 1, 2 * len(self._pos))
            self._pos = np.concatenate([self._pos, np.full(grow - len(self._pos), -1, dtype=np.int64)])
            self._readers = np.concatenate([self._readers, np.zeros(grow - len(self._readers), dtype=np.int64)])
            self._stamp = np.zeros(grow, dtype=np.int64)
        return ids

    def _place(self, ids: np.ndarray, first: int, num_hits: int) -> list[Move]:
        """Blocks `ids` are now the logical blocks `first...`; the first `num_hits` of them were cache hits."""
        n = len(ids)
        if n == 0:
            return []
        if len(self._starts) < first + n:
            self._starts = np.arange(2 * (first + n), dtype=np.int64) * self.block_size
        want = self._starts[first : first + n]
        order = self._starts[:n]  # any n distinct values
        self._stamp[ids] = order
        if (self._stamp[ids] != order).any():  # one block twice in a request: sequential semantics, block by block
            moves: list[Move] = []
            for j, b in enumerate(ids.tolist()):
                moves += self._place(np.array([b], dtype=np.int64), first + j, 1 if j < num_hits else 0)
            return moves
        moves = []
        hits = ids[:num_hits]
        if len(hits):
            have = self._pos[hits]
            moved = (have >= 0) & (have != want[:num_hits])
            if moved.any():
                blocks = hits[moved]
                self.conflicts += int(np.count_nonzero(self._readers[blocks]))
                moves = list(map(_new_move, zip(blocks.tolist(), (want[:num_hits] - have)[moved].tolist())))
        self._pos[ids] = want
        self._readers[ids] += 1
        return moves

    def new_request(self, req_id: str, block_ids: Sequence[int], num_computed_tokens: int) -> list[Move]:
        """A request scheduled for the first time (or resumed): its first blocks may be cache hits."""
        self.finish(req_id)
        ids = self._ids(block_ids)
        moves = self._place(ids, 0, min(len(ids), num_computed_tokens // self.block_size))
        self._blocks[req_id] = ids
        return moves

    def extend_request(self, req_id: str, new_block_ids: Sequence[int]) -> None:
        """Blocks appended to a running request are computed by it, at the next logical indices."""
        if not len(new_block_ids):
            return
        ids = self._ids(new_block_ids)
        held = self._blocks.get(req_id)
        self._place(ids, 0 if held is None else len(held), 0)
        self._blocks[req_id] = ids if held is None else np.concatenate([held, ids])

    def copied(self, src: int, dst: int) -> None:
        """Block `dst` was made a copy of `src` (CIDRA's duplicate): its keys encode the same position."""
        self._ids([src, dst])
        self._pos[dst] = self._pos[src]

    def loaded(self, block_id: int, position: int) -> None:
        """Block `block_id` was filled from a tier with keys that encode `position` (the next placement that
        reads it elsewhere moves it, as any cached block)."""
        self._ids([block_id])
        self._pos[block_id] = position

    def finish(self, req_id: str) -> None:
        ids = self._blocks.pop(req_id, None)
        if ids is not None and len(ids):
            np.subtract.at(self._readers, ids, 1)


@dataclass(frozen=True)
class KLayout:
    """Where key (token t, dim d) of one (block, head) lives: `flat_index[t, d]` is its offset in the K region.

    Two layouts are common and get a fast path in `KVRelocator`: row-major (`[tokens, head_dim]`, GPU-style and
    CPU attention's AMX path) and transposed (`[head_dim, tokens]`, CPU attention's AVX2 "vec" path); `kind`
    says which one this is, or "other".
    """

    block_size: int
    head_dim: int
    flat_index: torch.Tensor  # [block_size, head_dim], long

    @classmethod
    def row_major(cls, block_size: int, head_dim: int) -> KLayout:
        return cls(block_size, head_dim, torch.arange(block_size * head_dim).view(block_size, head_dim))

    @classmethod
    def transposed(cls, block_size: int, head_dim: int) -> KLayout:
        """Keys stored `[head_dim, tokens]` per (block, head): dim d of token t at `d * block_size + t`."""
        return cls(block_size, head_dim, torch.arange(block_size * head_dim).view(head_dim, block_size).t())

    @cached_property
    def kind(self) -> str:
        """"row_major", "transposed", or "other" (any other permutation: moved through a gather)."""
        index = self.flat_index.cpu()
        if torch.equal(index, KLayout.row_major(self.block_size, self.head_dim).flat_index):
            return "row_major"
        if torch.equal(index, KLayout.transposed(self.block_size, self.head_dim).flat_index):
            return "transposed"
        return "other"


# Temporary K copies are cut to about this size on the CPU, so the rotation's passes run in cache and the
# KV cache itself is read once and written once, as by a copy.
_CPU_CHUNK_BYTES = 1 << 20


_UNSET = object()


class KVRelocator:
    """Moves keys of whole blocks in CPU_ATTN caches (`[num_blocks, kv_heads, block_size, 2*head_dim]`, K first)."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], layout: KLayout, spec: RopeSpec, *, compiled: bool = True):
        """`compiled=False`: always the plain torch passes, even where spanq's compiled CPU op would apply."""
        self.kv_caches = list(kv_caches)
        self.compiled = compiled
        self.layout = layout
        self.spec = spec
        self.moved_blocks = 0
        self._op: object = _UNSET

    def _k_regions(self) -> Iterable[torch.Tensor]:
        bs, hd = self.layout.block_size, self.layout.head_dim
        for kv in self.kv_caches:
            nb, heads = kv.shape[0], kv.shape[1]
            yield kv.view(nb, heads, 2 * bs * hd)[:, :, : bs * hd]

    @property
    def uses_compiled_kernel(self) -> bool:
        return bool(self.kv_caches) and self._compiled_op() is not None

    def apply(self, moves: Sequence[Move]) -> None:
        """Rotate each moved block's keys by its delta, in place, all blocks of all layers in one pass per layer.

        Moves of the same block add up. On the CPU, with a row-major or transposed K layout, spanq's compiled op
        does it (`kernels.relocate_keys_op`: one pass that reads and writes each moved key once, all layers in
        one call). Otherwise each layer's moved blocks are gathered (in chunks that stay in cache on
        the CPU), rotated with per-block cos/sin, and scattered back; row-major and transposed layouts are read
        through strided views, any other layout through `flat_index`. Plain torch: runs on any device.
        """
        net: dict[int, int] = {}
        for b, d in moves:
            net[b] = net.get(b, 0) + d
        net = {b: net[b] for b in sorted(net) if net[b]}  # by block id: neighbours in the cache form runs
        if not net or not self.kv_caches:
            return
        spec = self.spec
        if max(map(abs, net.values())) > spec.max_delta:
            raise RelocationError(f"a delta exceeds the rotary table ({spec.max_delta} positions)")
        first = self.kv_caches[0]
        op = self._compiled_op()
        if op is not None:
            layout = self.layout
            op(self.kv_caches, list(net), list(net.values()), self._op_table, layout.block_size, layout.head_dim,
               spec.rotary_dim, spec.is_neox_style, layout.kind == "transposed")
            self.moved_blocks += len(net)
            return
        device, work = first.device, torch.promote_types(first.dtype, torch.float32)
        table = getattr(self, "_rotary_table", None)
        if table is None or table.device != device or table.dtype != work:
            table = self._rotary_table = spec.cos_sin_cache.to(device=device, dtype=work)
        ids = torch.tensor(list(net), dtype=torch.long, device=device)
        deltas = torch.tensor(list(net.values()), dtype=torch.long, device=device)
        half = spec.rotary_dim // 2
        rows = table[deltas.abs()]  # [n, rotary_dim]: cos half, then sin half
        cos, sin = rows[:, :half], rows[:, half:] * deltas.sign().to(work).unsqueeze(-1)
        bs = self.layout.block_size
        if self.layout.kind == "transposed":
            # [n, 1, half, tokens], materialized: a (block, head)'s x1 rows are one contiguous run, and so is
            # this, so the elementwise loops run over whole blocks instead of one row of tokens at a time.
            cos = cos[:, None, :, None].expand(-1, 1, -1, bs).contiguous()
            sin = sin[:, None, :, None].expand(-1, 1, -1, bs).contiguous()
        else:
            cos, sin = cos[:, None, None, :], sin[:, None, None, :]  # [n, 1, 1, half]

        hd = self.layout.head_dim
        kind = self.layout.kind
        index = None if kind != "other" else self.layout.flat_index.reshape(-1).to(device)
        heads = first.shape[1]
        per_block = heads * bs * hd * first.element_size()
        chunk = len(net) if device.type != "cpu" else max(1, min(len(net), _CPU_CHUNK_BYTES // per_block))
        # Reused scratch (fresh CPU buffers cost page faults on every step): one chunk of K, and x1 * sin.
        scratch = getattr(self, "_scratch", None)
        if scratch is None or scratch[0].shape[0] < chunk or (scratch[0].dtype, scratch[0].device) != (
            first.dtype, device
        ):
            scratch = self._scratch = (
                torch.empty(chunk, heads, bs * hd, dtype=first.dtype, device=device),
                torch.empty(chunk * heads * bs * (spec.rotary_dim // 2), dtype=work, device=device),
            )
        block_ids = list(net)
        runs = [_runs(block_ids[lo : lo + chunk]) for lo in range(0, len(net), chunk)]
        row_ids = None  # moved blocks' K rows in a `[blocks * heads * 2, bs * hd]` view (K, V alternate)
        for kv, region in zip(self.kv_caches, self._k_regions()):
            for lo, chunk_runs in zip(range(0, len(net), chunk), runs):
                sel = ids[lo : lo + chunk]
                flat = scratch[0][: len(sel)]
                contiguous_runs = len(chunk_runs) * 4 <= len(sel)  # mostly consecutive blocks
                if contiguous_runs:
                    for at, first_block, length in chunk_runs:
                        flat[at : at + length].copy_(region[first_block : first_block + length])
                elif kv.is_contiguous():  # whole-row gather: index_select's memcpy path
                    if row_ids is None:
                        row_ids = ((ids[:, None] * heads + torch.arange(heads, device=device)) * 2).flatten()
                    chunk_rows = row_ids[lo * heads : (lo + len(sel)) * heads]
                    torch.index_select(kv.view(-1, bs * hd), 0, chunk_rows, out=flat.view(-1, bs * hd))
                else:
                    torch.index_select(region, 0, sel, out=flat)
                if kind == "row_major":
                    keys, axis = flat.unflatten(-1, (bs, hd)), -1
                elif kind == "transposed":
                    keys, axis = flat.unflatten(-1, (hd, bs)), -2  # dims on axis -2
                else:
                    keys, axis = flat[:, :, index].unflatten(-1, (bs, hd)), -1
                c, s = cos[lo : lo + chunk], sin[lo : lo + chunk]
                _rotate_(keys, c, s, axis, spec, scratch[1])
                if index is not None:
                    flat[:, :, index] = keys.flatten(-2)
                if contiguous_runs:  # plain copies into slices
                    for at, first_block, length in chunk_runs:
                        region[first_block : first_block + length].copy_(flat[at : at + length])
                else:
                    region.index_copy_(0, sel, flat)
        self.moved_blocks += len(net)

    def _compiled_op(self) -> object | None:
        """spanq's compiled CPU op when it applies to these caches (CPU, a known layout, one contiguous K run
        per block and head), else None: `apply` then runs the plain torch passes."""
        if self._op is _UNSET:
            op = None
            bs, hd = self.layout.block_size, self.layout.head_dim
            first = self.kv_caches[0]
            fits = self.compiled and self.layout.kind in ("row_major", "transposed") and all(
                kv.device.type == "cpu" and kv.dim() == 4 and kv.shape[2:] == (bs, 2 * hd) and kv.stride(3) == 1
                and kv.stride(2) == 2 * hd and kv.dtype == first.dtype and kv.shape[1] == first.shape[1]
                and kv.dtype in (torch.float32, torch.bfloat16, torch.float16)
                for kv in self.kv_caches
            )
            if fits:
                from spanq_backend.kv.kernels import relocate_keys_op

                op = relocate_keys_op()
            self._op = op
            self._op_table = self.spec.cos_sin_cache.detach().to(device="cpu", dtype=torch.float32).contiguous()
        return self._op


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids in a sorted list: (offset in the list, first id, length)."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            at, first, length = runs[-1]
            runs[-1] = (at, first, length + 1)
        else:
            runs.append((i, b, 1))
    return runs


def _rotate_(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, axis: int, spec: RopeSpec, scratch: torch.Tensor
) -> None:
    """Rotate `keys` in place along `axis` (its head_dim axis) by `cos`/`sin` broadcast over the other axes.

    `scratch` holds at least half of `keys`' elements, in `cos`' dtype."""
    half = spec.rotary_dim // 2
    if spec.is_neox_style:
        x1, x2 = keys.narrow(axis, 0, half), keys.narrow(axis, half, half)
    else:  # GPT-J style: pairs (2i, 2i + 1)
        pairs = keys.narrow(axis, 0, spec.rotary_dim).unflatten(axis, (half, 2))
        x1, x2 = pairs.select(axis, 0), pairs.select(axis, 1)
    if keys.dtype == cos.dtype:
        x1_sin = torch.mul(x1, sin, out=scratch[: x1.numel()].view(x1.shape))
        x1.mul_(cos).addcmul_(x2, sin, value=-1.0)  # x1 cos - x2 sin
        torch.addcmul(x1_sin, x2, cos, out=x2)  # x2 cos + x1 sin
    else:  # low precision: the arithmetic in float32, like rerope_
        a, b = x1.to(cos.dtype), x2.to(cos.dtype)
        x1.copy_(a * cos - b * sin)
        x2.copy_(b * cos + a * sin)
