"""Moving keys in KV caches whose K sits at its logical place: every GPU attention backend of vLLM 0.32.

vLLM 0.32 gives each layer's cache the logical shape `[blocks, kv_heads, block_size, 2 * head_dim]` (K in the
first `head_dim` of the last axis) and lays it out in memory by one of the permutations of `KVCacheLayout`
(`vllm/v1/kv_cache_layout.py`: LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC). The GPU backends' cache-write ops
(`do_kv_cache_update`: FlashAttention's and FlashInfer's `reshape_and_cache_flash`, Triton attention's
`triton_reshape_and_cache_flash`) write key (token t, dim d) of block b, head h at that logical place, so the
strides of the logical view say where every key is, whatever the layout. (vLLM's CPU attention does not: it
keeps K in an instruction-set-specific order inside each block, handled by `relocation.KVRelocator`.)

`StridedKVRelocator` rotates whole moved blocks in place through those strides: a Triton kernel on CUDA (one
launch for all layers and moved blocks when the layers are views of one allocation with a constant layer
stride, else one per layer; `triton_relocate.py`), plain torch elsewhere (gather, `rerope_`, scatter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from spanq_backend.kv.relocation import Move
from spanq_backend.kv.rerope import RelocationError, RopeSpec, rerope_

__all__ = ["StridedKVRelocator", "logical_keys"]

Kernel = Literal["auto", "torch", "triton"]


def logical_keys(kv: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The K half of one layer's logical cache view: `[blocks, kv_heads, block_size, head_dim]` (a view)."""
    if kv.dim() != 4 or kv.shape[-1] != 2 * head_dim:
        raise RelocationError(
            f"a KV cache of shape {tuple(kv.shape)} is not [blocks, kv_heads, block_size, 2 * {head_dim}]"
        )
    return kv[..., :head_dim]


class StridedKVRelocator:
    """Moves keys of whole blocks in caches whose K is at its logical place (any `KVCacheLayout`)."""

    def __init__(
        self, kv_caches: Sequence[torch.Tensor], spec: RopeSpec, *, kernel: Kernel = "auto"
    ) -> None:
        """`kernel`: "triton" (the Triton kernel, on any device Triton runs on, its interpreter included),
        "torch" (the plain torch passes), or "auto" (Triton on CUDA when it imports, else torch)."""
        self.kv_caches = list(kv_caches)
        self.spec = spec
        self.keys = [logical_keys(kv, spec.head_dim) for kv in self.kv_caches]
        self.moved_blocks = 0
        if kernel == "auto":
            kernel = "triton" if self.kv_caches and self.kv_caches[0].is_cuda and _triton_available() else "torch"
        self.kernel: Kernel = kernel
        self._table: torch.Tensor | None = None

    @property
    def uses_compiled_kernel(self) -> bool:
        return self.kernel == "triton"

    def _net(self, moves: Sequence[Move]) -> dict[int, int]:
        net: dict[int, int] = {}
        for b, d in moves:
            net[b] = net.get(b, 0) + d
        net = {b: d for b, d in sorted(net.items()) if d}
        if net and max(map(abs, net.values())) > self.spec.max_delta:
            raise RelocationError(f"a delta exceeds the rotary table ({self.spec.max_delta} positions)")
        return net

    def apply(self, moves: Sequence[Move]) -> None:
        """Rotate each moved block's keys by its delta (moves of one block add up), in place, in every layer."""
        net = self._net(moves)
        if not net or not self.kv_caches:
            return
        device = self.kv_caches[0].device
        ids = torch.tensor(list(net), dtype=torch.long, device=device)
        deltas = torch.tensor(list(net.values()), dtype=torch.long, device=device)
        if self.kernel == "triton":
            from spanq_backend.kv.triton_relocate import relocate_keys

            if self._table is None or self._table.device != device:
                self._table = self.spec.cos_sin_cache.to(device=device, dtype=torch.float32).contiguous()
            relocate_keys(self.keys, ids, deltas, self._table, self.spec.rotary_dim, self.spec.is_neox_style)
        else:
            for keys in self.keys:
                moved = keys[ids]  # [n, heads, block_size, head_dim]: a copy, whatever the strides
                rerope_(moved, deltas[:, None, None], self.spec)
                keys[ids] = moved
        self.moved_blocks += len(net)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
