"""ReRoPE relocation throughput on a GPU: `spanq_backend.kv.relocation.KVRelocator` beside a plain copy of the same bytes.

Self-contained: needs torch (with CUDA) and this repository's `spanq_backend/rerope.py` and `relocation.py`, which
import nothing but torch — vLLM need not be installed. Run from the repository root:

    python scripts/bench_rerope_gpu.py                       # CUDA if available, else the CPU
    python scripts/bench_rerope_gpu.py --dtype bfloat16 --out results/rerope/rerope-gpu.json

For each KV shape (layers x KV heads x head_dim), number of moved blocks and block pattern (scattered, or runs
of 8 consecutive blocks), it times `KVRelocator.apply` on a synthetic cache in the CPU_ATTN layout
(`[blocks, kv_heads, block_size, 2*head_dim]`, K first, K row-major — the same code path the CPU runs), every
moved block with its own delta, and, in the same repetition, `dst.copy_(src)` of the same number of K bytes
(read once, written once: what an ideal in-place rotation costs). It prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spanq_backend.kv.relocation import KLayout, KVRelocator, Move
from spanq_backend.kv.rerope import RopeSpec, rerope_

SHAPES = {
    "tiny": (4, 2, 64),  # spanq's tiny test model
    "tiny-4h": (4, 4, 64),
    "smollm2": (30, 3, 64),  # SmolLM2-135M
    "llama3-8b": (32, 8, 128),  # a common serving model, for scale
}


def rope_spec(head_dim: int, max_positions: int = 8192, theta: float = 1e5) -> RopeSpec:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None]
    return RopeSpec.from_cos_sin_cache(torch.cat([angles.cos(), angles.sin()], -1), head_dim, head_dim, True)


def moved_blocks(num_blocks: int, count: int, pattern: str, rng: random.Random, run: int = 8) -> list[int]:
    if pattern == "scattered":
        return rng.sample(range(num_blocks), count)
    starts = rng.sample(range(0, num_blocks - run, run), (count + run - 1) // run)
    return [s + i for s in starts for i in range(run)][:count]


class Timer:
    """Wall time of a callable on `device`: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t


def check(device: torch.device, dtype: torch.dtype) -> float:
    """Max |error| of KVRelocator against rerope_ block by block, on this device and dtype."""
    bs, hd, heads = 32, 64, 2
    spec = rope_spec(hd)
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(12, heads, bs, 2 * hd, generator=gen).to(device=device, dtype=dtype)
    k = lambda t: t.view(12, heads, 2, bs, hd)[:, :, 0]
    expected = k(kv).float().clone()
    moves = [Move(b, d) for b, d in ((1, 32), (2, -64), (3, 33), (7, 1000), (8, 32), (9, 32))]
    KVRelocator([kv], KLayout.row_major(bs, hd), spec).apply(moves)
    for m in moves:
        rerope_(expected[m.block_id], m.delta, spec)
    return float((k(kv).float() - expected).abs().max())


def run(shape: str, moved: int, pattern: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    layers, heads, hd = SHAPES[shape]
    bs = args.block_size
    caches = [torch.full((args.num_blocks, heads, bs, 2 * hd), 0.5, device=device, dtype=dtype) for _ in range(layers)]
    rng = random.Random(args.seed)
    moves = [Move(b, rng.choice((-1, 1)) * bs * rng.randint(1, 64))
             for b in moved_blocks(args.num_blocks, moved, pattern, rng)]
    relocator = KVRelocator(caches, KLayout.row_major(bs, hd), rope_spec(hd))
    k_elems = moved * layers * heads * bs * hd
    src = torch.full((k_elems,), 0.25, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    timer = Timer(device)
    for _ in range(3):  # warm-up: kernels, scratch buffers, the rotary table on the device
        relocator.apply(moves)
        dst.copy_(src)
    reloc, copy = [], []
    for _ in range(args.reps):
        copy.append(timer(lambda: dst.copy_(src)))
        reloc.append(timer(lambda: relocator.apply(moves)))
    del caches
    tokens = moved * bs
    k_bytes = k_elems * src.element_size()
    r_med, c_med = statistics.median(reloc), statistics.median(copy)
    return {
        "shape": shape, "layers": layers, "kv_heads": heads, "head_dim": hd, "pattern": pattern,
        "moved_blocks": moved, "tokens": tokens, "k_bytes": k_bytes,
        "relocate_ms_median": r_med * 1e3, "relocate_ms_min": min(reloc) * 1e3,
        "copy_ms_median": c_med * 1e3, "copy_ms_min": min(copy) * 1e3,
        "relocate_tokens_per_ms": tokens / (r_med * 1e3), "copy_tokens_per_ms": tokens / (c_med * 1e3),
        "relocate_gb_per_s": 2 * k_bytes / r_med / 1e9, "copy_gb_per_s": 2 * k_bytes / c_med / 1e9,
        "fraction_of_copy": statistics.median(c / r for c, r in zip(copy, reloc)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--moved", default="16,64,256,1024", help="blocks moved per step (all layers)")
    parser.add_argument("--patterns", default="scattered,runs")
    parser.add_argument("--num-blocks", type=int, default=4096, help="cache blocks per layer")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/rerope/rerope-gpu.json"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads when running on the CPU")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    error = check(device, dtype)
    rows = []
    for shape in args.shapes.split(","):
        for moved in (int(m) for m in args.moved.split(",")):
            if moved > args.num_blocks // 2:
                continue
            for pattern in args.patterns.split(","):
                rows.append(run(shape, moved, pattern, args, device, dtype))
                r = rows[-1]
                print(f"{shape:<10} {pattern:<9} {moved:>5} blocks: relocate {r['relocate_ms_median']:8.3f} ms "
                      f"= {r['relocate_tokens_per_ms']:10.0f} tok/ms ({r['relocate_gb_per_s']:7.1f} GB/s); copy "
                      f"{r['copy_gb_per_s']:7.1f} GB/s; {r['fraction_of_copy']:.2f} of copy", flush=True)
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": args.dtype, "block_size": args.block_size,
        "num_blocks": args.num_blocks, "reps": args.reps, "max_abs_error_vs_rerope": error,
        "command": " ".join(sys.argv),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "rerope-gpu", "config": info, "rows": rows}, indent=2) + "\n")
    print(f"max |error| vs rerope_: {error:.2e}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
