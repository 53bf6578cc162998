"""KV caches in every `KVCacheLayout` vLLM 0.32 defines, on CPU tensors, and the reference for moving their keys.

Shared by `test_kv_layouts.py` (torch passes, in process) and the Triton interpreter run it starts
(`python -m tests.backend.kv_layout_cases`, with `TRITON_INTERPRET=1`), which prints one JSON line per case.
"""

from __future__ import annotations

import json
import sys

import torch

from spanq_backend.kv.relocation import Move
from spanq_backend.kv.rerope import RopeSpec, rerope_

LAYOUTS = {  # logical [L, B, H, N, C] -> physical order, as vllm/v1/kv_cache_layout.py defines them
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
ROPES = {  # name -> (rotary_dim, neox)
    "neox": (64, True),
    "gptj": (64, False),
    "partial-neox": (32, True),
}
LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 3, 9, 2, 16, 64
MOVES = [Move(1, 37), Move(4, -5), Move(7, 300), Move(4, 2)]  # block 4 moves twice: -3 net


def spec_of(rope: str, positions: int = 1024) -> RopeSpec:
    rotary_dim, neox = ROPES[rope]
    inv = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None]
    table = torch.cat([angles.cos(), angles.sin()], -1).float()
    return RopeSpec.from_cos_sin_cache(table, rotary_dim, HEAD_DIM, neox)


def caches(layout: str, dtype: torch.dtype, seed: int = 0, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Per-layer logical views `[blocks, heads, block_size, 2 * head_dim]` of one allocation in `layout`."""
    order = LAYOUTS[layout]
    logical = (LAYERS, BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    gen = torch.Generator().manual_seed(seed)
    physical = torch.randn([logical[a] for a in order], generator=gen).to(dtype).to(device)
    view = physical.permute([order.index(a) for a in range(5)])  # back to the logical axes
    assert tuple(view.shape) == logical
    return [view[layer] for layer in range(LAYERS)]


def reference(kv_caches: list[torch.Tensor], spec: RopeSpec) -> list[torch.Tensor]:
    """What the caches must hold after `MOVES`: K of moved blocks rotated (in float32, then rounded once)."""
    net: dict[int, int] = {}
    for b, d in MOVES:
        net[b] = net.get(b, 0) + d
    out = []
    for kv in kv_caches:
        want = kv.clone()
        for b, d in net.items():
            keys = kv[b, :, :, :HEAD_DIM].float().clone()
            want[b, :, :, :HEAD_DIM] = rerope_(keys, d, spec).to(kv.dtype)
        out.append(want)
    return out


def run(layout: str, dtype: torch.dtype, rope: str, kernel: str, negate: bool = False) -> float:
    """Max |difference| from the reference after moving keys with `kernel` ("torch" or "triton")."""
    from spanq_backend.kv.strided import StridedKVRelocator

    spec = spec_of(rope)
    kv = caches(layout, dtype)
    want = reference(kv, spec)
    moves = [m._replace(delta=-m.delta) for m in MOVES] if negate else MOVES
    StridedKVRelocator(kv, spec, kernel=kernel).apply(moves)
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(kv, want))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

if __name__ == "__main__":  # the Triton interpreter run: every layout, dtype and rotary style
    for layout in LAYOUTS:
        for dname, dtype in DTYPES.items():
            for rope in ROPES:
                err = run(layout, dtype, rope, "triton")
                print(json.dumps({"layout": layout, "dtype": dname, "rope": rope, "err": err}), flush=True)
    print(json.dumps({"negated": run("LBNHC", torch.float32, "neox", "triton", negate=True)}), flush=True)
    sys.exit(0)
