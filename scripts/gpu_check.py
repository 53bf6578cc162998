"""The GPU check: the Triton relocation kernel on CUDA, for correctness and against device-copy bandwidth.

Needs torch with CUDA and Triton; not vLLM (a GPU machine without vLLM can run it). From the repository root:

    python scripts/gpu_check.py                    # about 2-4 minutes; writes results/gpu/gpu-check.json

1. Correctness: every case of `tests/backend/kv_layout_cases.py` (the six `KVCacheLayout`s x fp32/bf16/fp16 x
   NeoX/GPT-J/partial rotary), moved by the kernel on the GPU, against the reference rotation (`rerope_`); and a
   negated delta, which must miss. Exit status 1 if any case fails.
2. Throughput: a cache shaped like SmolLM2-135M's (30 layers x 3 KV heads x 64) and like Llama-3-8B's
   (32 x 8 x 128), block size 16, bf16, in vLLM's default layout (LBNHC: per layer `[blocks, tokens, heads,
   2*head_dim]` in memory) with all layers in one allocation; 64 / 256 / 1024 moved blocks, scattered; beside
   each, in the same repetition, a device-to-device copy of the same K bytes. Goal: >= 50% of copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from spanq_backend.kv.relocation import Move
from spanq_backend.kv.rerope import RopeSpec
from spanq_backend.kv.strided import StridedKVRelocator
from tests.backend import kv_layout_cases as cases

SHAPES = {"smollm2": (30, 3, 64), "llama3-8b": (32, 8, 128)}  # layers, KV heads, head_dim


def correctness(device: torch.device) -> list[dict]:
    """Each case on `device` with the Triton kernel: max |error| against the reference, and whether it passes."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-5, torch.float16: 2.0**-8}
    rows = []
    for layout in cases.LAYOUTS:
        for dname, dtype in cases.DTYPES.items():
            for rope in cases.ROPES:
                spec = cases.spec_of(rope)
                kv = cases.caches(layout, dtype, device=device)
                want = cases.reference([k.cpu() for k in kv], spec)
                StridedKVRelocator(kv, spec, kernel="triton").apply(cases.MOVES)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                err = max(float((a.cpu().float() - b.float()).abs().max()) for a, b in zip(kv, want))
                rows.append({"layout": layout, "dtype": dname, "rope": rope, "err": err, "ok": err <= tol[dtype]})
    spec = cases.spec_of("neox")
    kv = cases.caches("LBNHC", torch.float32, device=device)
    want = cases.reference([k.cpu() for k in kv], spec)
    StridedKVRelocator(kv, spec, kernel="triton").apply([m._replace(delta=-m.delta) for m in cases.MOVES])
    err = max(float((a.cpu() - b).abs().max()) for a, b in zip(kv, want))
    rows.append({"layout": "LBNHC", "dtype": "fp32", "rope": "neox", "negated": True, "err": err, "ok": err > 1e-2})
    return rows


def spec_for(head_dim: int, positions: int = 8192) -> RopeSpec:
    inv = 1.0 / (5e5 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None]
    return RopeSpec.from_cos_sin_cache(torch.cat([angles.cos(), angles.sin()], -1), head_dim, head_dim, True)


def throughput(device: torch.device, shape: str, moved: int, blocks: int, reps: int) -> dict:
    layers, heads, hd = SHAPES[shape]
    bs = 16
    # LBNHC: [layers, blocks, tokens, heads, 2*hd] in memory; logical per-layer view [blocks, heads, tokens, 2*hd].
    physical = torch.full((layers, blocks, bs, heads, 2 * hd), 0.5, device=device, dtype=torch.bfloat16)
    kv = [physical[layer].permute(0, 2, 1, 3) for layer in range(layers)]
    rng = random.Random(0)
    moves = [Move(b, rng.choice((-1, 1)) * bs * rng.randint(1, 64)) for b in rng.sample(range(blocks), moved)]
    relocator = StridedKVRelocator(kv, spec_for(hd), kernel="triton")
    k_elems = moved * layers * heads * bs * hd
    src = torch.full((k_elems,), 0.25, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)

    def timed(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    for _ in range(3):
        relocator.apply(moves)
        dst.copy_(src)
    reloc, copy = [], []
    for _ in range(reps):
        copy.append(timed(lambda: dst.copy_(src)))
        reloc.append(timed(lambda: relocator.apply(moves)))
    k_bytes = k_elems * 2
    r, c = statistics.median(reloc), statistics.median(copy)
    return {
        "shape": shape, "moved_blocks": moved, "tokens": moved * bs, "k_bytes": k_bytes,
        "relocate_ms": r * 1e3, "copy_ms": c * 1e3, "relocate_tokens_per_ms": moved * bs / (r * 1e3),
        "relocate_gb_per_s": 2 * k_bytes / r / 1e9, "copy_gb_per_s": 2 * k_bytes / c / 1e9,
        "fraction_of_copy": statistics.median(cc / rr for cc, rr in zip(copy, reloc)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8192, help="cache blocks per layer")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "results/gpu/gpu-check.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    t0 = time.perf_counter()
    checks = correctness(device)
    failed = [c for c in checks if not c["ok"]]
    print(f"correctness: {len(checks) - len(failed)} of {len(checks)} cases pass", flush=True)
    for c in failed:
        print("  FAILED", c, flush=True)
    rows = []
    for shape in SHAPES:
        for moved in (64, 256, 1024):
            rows.append(throughput(device, shape, moved, args.blocks, args.reps))
            r = rows[-1]
            print(f"{shape:<10} {moved:>5} blocks: {r['relocate_ms']:.3f} ms, {r['relocate_tokens_per_ms']:.0f} tokens/ms, "
                  f"{r['relocate_gb_per_s']:.0f} GB/s vs copy {r['copy_gb_per_s']:.0f} GB/s: "
                  f"{r['fraction_of_copy']:.2f} of copy", flush=True)
    out = {
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "seconds": time.perf_counter() - t0,
        "correctness": checks, "throughput": rows, "command": " ".join(sys.argv),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
