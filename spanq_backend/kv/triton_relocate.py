"""The Triton relocation kernel: rotate the keys of moved blocks in place, through the cache's strides.

One program per (moved block, KV head, layer): it loads the block's rotary pairs of that head as two
`[block_size, rotary_dim / 2]` tiles, rotates them by the block's delta in float32 (cos and sin from the model's
rotary table, sin negated for a negative delta) and stores them back in the cache's dtype. NeoX style pairs dim
i with i + rotary_dim / 2, GPT-J style 2i with 2i + 1; dims past `rotary_dim` (partial rotary) are not touched.
When the layers are views of one allocation with a constant stride between them (vLLM's layer-inner
`KVCacheLayout`s), one launch covers every layer; otherwise there is one launch per layer. Every key is read
once and written once, as by a copy. Tested on CPU under Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

__all__ = ["relocate_keys"]


@triton.jit
def _relocate_kernel(
    k_ptr,
    ids_ptr,
    deltas_ptr,
    table_ptr,
    stride_layer,
    stride_block,
    stride_head,
    stride_token,
    stride_dim,
    table_stride,
    block_size,
    half,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NEOX: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    layer = tl.program_id(2)
    block = tl.load(ids_ptr + i).to(tl.int64)
    delta = tl.load(deltas_ptr + i).to(tl.int64)
    row = tl.abs(delta)
    sign = tl.where(delta < 0, -1.0, 1.0)
    j = tl.arange(0, BLOCK_H)
    jm = j < half
    cos = tl.load(table_ptr + row * table_stride + j, mask=jm, other=1.0).to(tl.float32)
    sin = tl.load(table_ptr + row * table_stride + half + j, mask=jm, other=0.0).to(tl.float32) * sign
    t = tl.arange(0, BLOCK_T)
    tm = t < block_size
    if NEOX:
        d1 = j
        d2 = j + half
    else:
        d1 = 2 * j
        d2 = 2 * j + 1
    base = layer.to(tl.int64) * stride_layer + block * stride_block + head.to(tl.int64) * stride_head
    rows = base + t[:, None].to(tl.int64) * stride_token
    p1 = k_ptr + rows + d1[None, :].to(tl.int64) * stride_dim
    p2 = k_ptr + rows + d2[None, :].to(tl.int64) * stride_dim
    m = tm[:, None] & jm[None, :]
    x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=m, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    tl.store(p1, (x1 * c - x2 * s).to(k_ptr.dtype.element_ty), mask=m)
    tl.store(p2, (x2 * c + x1 * s).to(k_ptr.dtype.element_ty), mask=m)


def _layer_stride(keys: Sequence[torch.Tensor]) -> int | None:
    """The constant element stride between the layers' K views, if they are views of one allocation with
    equal shapes, strides and dtypes; None otherwise."""
    if len(keys) < 2:
        return 0
    first = keys[0]
    size = first.element_size()
    step = keys[1].data_ptr() - first.data_ptr()
    if step % size:
        return None
    for i, k in enumerate(keys):
        if (
            k.shape != first.shape
            or k.stride() != first.stride()
            or k.dtype != first.dtype
            or k.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or k.data_ptr() - first.data_ptr() != i * step
        ):
            return None
    return step // size


def relocate_keys(
    keys: Sequence[torch.Tensor],
    ids: torch.Tensor,
    deltas: torch.Tensor,
    table: torch.Tensor,
    rotary_dim: int,
    neox: bool,
) -> None:
    """Rotate blocks `ids` of every K view in `keys` (`[blocks, heads, block_size, head_dim]`, any strides) by
    `deltas` positions, in place. `table` is the model's rotary table in float32, `[positions, rotary_dim]`
    (cos half, then sin half); `ids` and `deltas` are int64 on the caches' device."""
    if not len(keys) or not len(ids):
        return
    half = rotary_dim // 2
    first = keys[0]
    _, heads, block_size, _ = first.shape
    meta = {"BLOCK_T": triton.next_power_of_2(block_size), "BLOCK_H": triton.next_power_of_2(half), "NEOX": bool(neox)}
    ids = ids.contiguous()
    deltas = deltas.contiguous()
    step = _layer_stride(keys)
    groups = [(first, step, len(keys))] if step is not None else [(k, 0, 1) for k in keys]
    for k, layer_stride, layers in groups:
        sb, sh, st, sd = k.stride()
        _relocate_kernel[(len(ids), heads, layers)](
            k, ids, deltas, table, layer_stride, sb, sh, st, sd, table.stride(0), block_size, half, **meta
        )
