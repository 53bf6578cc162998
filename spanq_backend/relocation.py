"""Where each cached block's keys sit, and moving them: the runner-side half of span reuse.

`BlockPositionTracker` follows the scheduler's output step by step: a block computed at logical block j of a
request encodes position `j * block_size`; a prefix-cache hit of that block at another logical index needs
its keys re-rotated by the difference before the forward pass. `KVRelocator` applies those moves to the KV
cache tensors in place (K only; V does not depend on position). Both are plain Python/torch, testable
without vLLM.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .rerope import RelocationError, RopeSpec

__all__ = ["BlockPositionTracker", "KLayout", "KVRelocator", "Move"]


@dataclass(frozen=True)
class Move:
    block_id: int
    delta: int  # positions to add to the block's keys


@dataclass
class BlockPositionTracker:
    block_size: int
    position: dict[int, int] = field(default_factory=dict)  # block id -> position of its first token's key
    users: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))  # block id -> running requests
    _blocks: dict[str, list[int]] = field(default_factory=dict)  # request -> its blocks, in logical order
    conflicts: int = 0  # moves of a block another running request reads at another position

    def _place(self, req_id: str, blocks: Sequence[int], first: int, num_hits: int, moves: list[Move]) -> None:
        for j, b in enumerate(blocks, start=first):
            want = j * self.block_size
            have = self.position.get(b)
            if j < num_hits and have is not None and have != want:
                if self.users.get(b, set()) - {req_id}:
                    self.conflicts += 1
                moves.append(Move(b, want - have))
            self.position[b] = want
            self.users[b].add(req_id)

    def new_request(self, req_id: str, block_ids: Sequence[int], num_computed_tokens: int) -> list[Move]:
        """A request scheduled for the first time (or resumed): its first blocks may be cache hits."""
        self.finish(req_id)
        moves: list[Move] = []
        self._place(req_id, block_ids, 0, num_computed_tokens // self.block_size, moves)
        self._blocks[req_id] = list(block_ids)
        return moves

    def extend_request(self, req_id: str, new_block_ids: Sequence[int]) -> None:
        """Blocks appended to a running request are computed by it, at the next logical indices."""
        blocks = self._blocks.setdefault(req_id, [])
        self._place(req_id, new_block_ids, len(blocks), 0, [])
        blocks.extend(new_block_ids)

    def copied(self, src: int, dst: int) -> None:
        """Block `dst` was made a copy of `src` (CIDRA's duplicate): its keys encode the same position."""
        if src in self.position:
            self.position[dst] = self.position[src]

    def finish(self, req_id: str) -> None:
        for b in self._blocks.pop(req_id, ()):
            users = self.users.get(b)
            if users is not None:
                users.discard(req_id)
                if not users:
                    del self.users[b]


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


class KVRelocator:
    """Moves keys of whole blocks in CPU_ATTN caches (`[num_blocks, kv_heads, block_size, 2*head_dim]`, K first)."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], layout: KLayout, spec: RopeSpec):
        self.kv_caches = list(kv_caches)
        self.layout = layout
        self.spec = spec
        self.moved_blocks = 0

    def _k_regions(self) -> Iterable[torch.Tensor]:
        bs, hd = self.layout.block_size, self.layout.head_dim
        for kv in self.kv_caches:
            nb, heads = kv.shape[0], kv.shape[1]
            yield kv.view(nb, heads, 2 * bs * hd)[:, :, : bs * hd]

    def apply(self, moves: Sequence[Move]) -> None:
        """Rotate each moved block's keys by its delta, in place, all blocks of all layers in one pass per layer.

        Moves of the same block add up. Each layer's moved blocks are gathered (in chunks that stay in cache on
        the CPU), rotated with per-block cos/sin, and scattered back; row-major and transposed layouts are read
        through strided views, any other layout through `flat_index`. Plain torch: runs on any device.
        """
        net: dict[int, int] = {}
        for m in moves:
            net[m.block_id] = net.get(m.block_id, 0) + m.delta
        net = {b: net[b] for b in sorted(net) if net[b]}  # by block id: neighbours in the cache form runs
        if not net or not self.kv_caches:
            return
        spec = self.spec
        if max(abs(d) for d in net.values()) > spec.max_delta:
            raise RelocationError(f"a delta exceeds the rotary table ({spec.max_delta} positions)")
        first = self.kv_caches[0]
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
