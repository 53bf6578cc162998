"""`spanq bench rerope`: how fast cached keys move (ReRoPE through `KVRelocator`), and what CIDRA planning costs.

Repositioning: synthetic KV caches in vLLM's CPU_ATTN layout (`[blocks, kv_heads, block_size, 2*head_dim]`, K
first, K stored in the layout `kv_layout.discover_cpu_k_layout` finds on this machine, or row-major), for the
tiny model's KV shape and SmolLM2's. `--moved` blocks of every layer move, each by its own delta, either
scattered over the cache or in runs of consecutive blocks (as a span's blocks usually are). Beside each timing,
in the same repetition, a plain copy of the same number of K bytes (read once, written once: the memory-
bandwidth limit of an in-place rotation). Throughput is moved tokens per ms (all layers of a token).

`x copy` is the relocator as spanq runs it (its compiled CPU op, `kernels.relocate_keys_op`, where it applies);
`torch x copy` the plain torch passes it falls back to (GPU, other layouts, no compiler).

Planning: `cidra.CidraPlanner` (scheduler side: plan and admit) and `relocation.BlockPositionTracker`
(runner side: the moves) for `--requests` requests x `--spans` spans admitted in one step, in microseconds,
against the time of one decode step of the tiny model measured on the engine (`--no-decode` skips it).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.common import (
    BenchReport,
    base_parser,
    format_table,
    names_from,
    new_figure,
    percentile,
    positive_int,
    positive_int_list,
    progress,
    summarize,
)

__all__ = ["KV_SHAPES", "KVShape", "main"]


@dataclass(frozen=True)
class KVShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int = 64


KV_SHAPES = {
    "tiny": KVShape("tiny", 4, 2),  # the tiny random Llama spanq tests on
    "tiny-4h": KVShape("tiny-4h", 4, 4),  # 4 layers x 4 KV heads x 64 dims: the shape of the first relocation measurements
    "smollm2": KVShape("smollm2", 30, 3),  # SmolLM2-135M
}


def rope_spec(head_dim: int, max_positions: int = 8192, theta: float = 1e5) -> Any:
    """A plain RoPE (neox style) like the models', as vLLM tabulates it."""
    import torch

    from spanq_backend.kv.rerope import RopeSpec

    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None]
    return RopeSpec.from_cos_sin_cache(torch.cat([angles.cos(), angles.sin()], -1), head_dim, head_dim, True)


def k_layout(kind: str, block_size: int, head_dim: int, dtype: str = "float32") -> Any:
    """The K layout: "discovered" (what vLLM's CPU kernel writes here for `dtype`: the instruction-set path, and so
    the layout, depends on it; row-major without vLLM), "row", "transposed"."""
    import torch

    from spanq_backend.kv.relocation import KLayout

    if kind == "row":
        return KLayout.row_major(block_size, head_dim)
    if kind == "transposed":
        return KLayout.transposed(block_size, head_dim)
    try:
        from types import SimpleNamespace

        from spanq_backend.vllm_integration.kv_layout import discover_cpu_k_layout

        cache = torch.empty(0, dtype=getattr(torch, dtype))
        return discover_cpu_k_layout(SimpleNamespace(kv_caches=[cache]), block_size, head_dim)
    except ImportError:
        return KLayout.row_major(block_size, head_dim)


def moved_blocks(num_blocks: int, count: int, pattern: str, rng: random.Random, run: int = 8) -> list[int]:
    """`count` distinct block ids: scattered at random, or in runs of `run` consecutive ids."""
    if pattern == "scattered":
        return rng.sample(range(num_blocks), count)
    starts = rng.sample(range(0, num_blocks - run, run), (count + run - 1) // run)
    return [s + i for s in starts for i in range(run)][:count]


def time_relocation(
    shape: KVShape, layout: Any, *, num_blocks: int, moved: int, pattern: str, reps: int, seed: int,
    device: str = "cpu", dtype: str = "float32",
) -> dict[str, Any]:
    """Relocator and plain-copy timings for one setting, paired repetition by repetition."""
    import torch

    from spanq_backend.kv.relocation import KVRelocator, Move

    bs, hd = layout.block_size, shape.head_dim
    # The values do not change the speed; a fill is much faster to set up than random numbers.
    caches = [
        torch.empty(num_blocks, shape.kv_heads, bs, 2 * hd, device=device, dtype=getattr(torch, dtype)).fill_(0.5)
        for _ in range(shape.layers)
    ]
    rng = random.Random(seed)
    blocks = moved_blocks(num_blocks, moved, pattern, rng)
    moves = [Move(b, rng.choice((-1, 1)) * bs * rng.randint(1, 64)) for b in blocks]
    relocator = KVRelocator(caches, layout, rope_spec(hd))  # spanq's compiled op where it applies
    fallback = KVRelocator(caches, layout, rope_spec(hd), compiled=False)  # the plain torch passes
    k_elems = moved * shape.layers * shape.kv_heads * bs * hd
    src = torch.empty(k_elems, device=device, dtype=getattr(torch, dtype)).fill_(0.25)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(fn: Callable[[], Any]) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    # The in-place baseline: read and write back the same scattered K blocks of every layer (gather, scatter),
    # no arithmetic — what any in-place pass over those blocks costs at best.
    ids = torch.tensor(sorted(blocks), dtype=torch.long, device=device)
    regions = [kv.view(num_blocks, shape.kv_heads, 2 * bs * hd)[:, :, : bs * hd] for kv in caches]

    def inplace() -> None:
        for region in regions:
            region.index_copy_(0, ids, region.index_select(0, ids))

    relocator.apply(moves)  # warm-up: the kernel build or load, scratch buffers, the rotary table on the device
    fallback.apply(moves)
    dst.copy_(src)
    inplace()
    reloc, copy, torch_only, in_place = [], [], [], []
    for _ in range(reps):
        copy.append(timed(lambda: dst.copy_(src)))
        in_place.append(timed(inplace))
        reloc.append(timed(lambda: relocator.apply(moves)))
        torch_only.append(timed(lambda: fallback.apply(moves)))
    tokens = moved * bs
    k_bytes = k_elems * src.element_size()
    ratios = [c / r for c, r in zip(copy, reloc)]
    return {
        "shape": shape.name, "layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": hd,
        "layout": layout.kind, "dtype": dtype, "compiled": relocator.uses_compiled_kernel, "pattern": pattern, "moved_blocks": moved, "tokens": tokens, "k_bytes": k_bytes,
        "relocate_s": summarize(reloc), "copy_s": summarize(copy),
        "relocate_tokens_per_ms": tokens / (summarize(reloc)["median"] * 1e3),
        "relocate_tokens_per_ms_best": tokens / (min(reloc) * 1e3),
        "copy_tokens_per_ms": tokens / (summarize(copy)["median"] * 1e3),
        "copy_gb_per_s": 2 * k_bytes / summarize(copy)["median"] / 1e9,
        "fraction_of_copy": percentile(ratios, 50),
        "fraction_of_copy_best": min(copy) / min(reloc),
        "inplace_s": summarize(in_place),
        "inplace_tokens_per_ms": tokens / (summarize(in_place)["median"] * 1e3),
        "fraction_of_inplace": percentile([i / r for i, r in zip(in_place, reloc)], 50),
        "cache_bytes": sum(kv.numel() * kv.element_size() for kv in caches),
        "torch_s": summarize(torch_only),
        "torch_tokens_per_ms": tokens / (summarize(torch_only)["median"] * 1e3),
        "torch_fraction_of_copy": percentile([c / t for c, t in zip(copy, torch_only)], 50),
    }


def check_relocation(layout: Any) -> float:
    """Max |difference| between `KVRelocator` and `rerope_` applied block by block (a correctness guard)."""
    import torch

    from spanq_backend.kv.relocation import KVRelocator, Move
    from spanq_backend.kv.rerope import rerope_

    bs, hd, heads = layout.block_size, layout.head_dim, 2
    spec = rope_spec(hd)
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(12, heads, bs, 2 * hd, generator=gen)
    index = layout.flat_index.reshape(-1)
    logical = kv.view(12, heads, -1)[:, :, : bs * hd][:, :, index].view(12, heads, bs, hd).clone()
    moves = [Move(b, d) for b, d in ((1, 32), (2, -64), (3, 33), (7, 1000), (8, 32), (9, 32))]
    KVRelocator([kv], layout, spec).apply(moves)
    for m in moves:
        rerope_(logical[m.block_id], m.delta, spec)
    after = kv.view(12, heads, -1)[:, :, : bs * hd][:, :, index].view(12, heads, bs, hd)
    return float((after - logical).abs().max())


def time_planning(requests: int, spans: int, blocks_per_span: int, block_size: int, reps: int) -> dict[str, Any]:
    """One step admitting `requests` requests, each hitting `spans` spans at shuffled places, planned by CIDRA and
    tracked by the runner's `BlockPositionTracker`; microseconds per step (median over `reps` steps)."""
    from spanq_backend.kv.cidra import CidraPlanner
    from spanq_backend.kv.relocation import BlockPositionTracker

    rng = random.Random(0)
    pool = [list(range(1 + s * blocks_per_span, 1 + (s + 1) * blocks_per_span)) for s in range(4 * spans)]
    steps_plan, steps_track, duplicates = [], [], 0
    for _ in range(reps):
        refs: dict[int, int] = {}  # block -> requests holding it
        planner = CidraPlanner(block_size, lambda b, refs=refs: refs.get(b, 0))  # users: ref count
        tracker = BlockPositionTracker(block_size, 1 + len(pool) * blocks_per_span)
        for s in pool:  # every span was prepared once, at logical block 1 (after a one-block anchor)
            tracker.new_request(f"prep{s[0]}", [0, *s], 0)
            tracker.finish(f"prep{s[0]}")
        layouts = []
        for _ in range(requests):
            chosen = rng.sample(pool, spans)
            layouts.append([0, *[b for s in chosen for b in s]])
        t = time.perf_counter()
        for blocks in layouts:
            plan = planner.plan(blocks)
            duplicates += len(plan.duplicate)
            planner.admitted(blocks)
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        steps_plan.append(time.perf_counter() - t)
        t = time.perf_counter()
        for r, blocks in enumerate(layouts):
            tracker.new_request(f"req{r}", blocks, len(blocks) * block_size)
        steps_track.append(time.perf_counter() - t)
    plan_us = summarize(steps_plan)["median"] * 1e6
    track_us = summarize(steps_track)["median"] * 1e6
    return {
        "requests": requests, "spans_per_request": spans, "blocks_per_span": blocks_per_span,
        "hit_blocks_per_request": 1 + spans * blocks_per_span,
        "cidra_plan_us_per_step": plan_us, "tracker_us_per_step": track_us,
        "total_us_per_step": plan_us + track_us, "duplicates_per_step": duplicates / max(1, reps),
    }


def measure_decode_step(model: str, batch: int, tokens: int) -> dict[str, Any]:
    """Seconds per decode step of `model` on the engine, for one sequence and for `batch` at once."""
    from benchmarks.common import close_backend, make_backend
    from spanq_integrations import execute, generate, plus, user

    backend = make_backend(model, spans=False, max_model_len=2048, max_num_seqs=max(16, batch))
    try:
        out = {}
        for n in (1, batch):
            calls = [generate(user(f"Count to one hundred, line {i}."), max_tokens=tokens, temperature=1.0, seed=i)
                     for i in range(n)]
            execute(calls[0] if n == 1 else plus(*calls), backend)  # warm-up
            result = execute(calls[0] if n == 1 else plus(*calls), backend)
            decode = [(c.wall_s - (c.ttft_s or 0.0)) / max(1, c.generated_tokens - 1) for c in result.calls]
            out[f"decode_step_s_batch{n}"] = max(decode)
        return out
    finally:
        close_backend(backend)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = base_parser("rerope", __doc__, model="tiny", reps=15)
    parser.add_argument("--shapes", type=names_from(tuple(KV_SHAPES), "shapes"), default=["tiny", "tiny-4h", "smollm2"],
                        help=f"KV shapes, of {', '.join(KV_SHAPES)} (default: tiny,tiny-4h,smollm2)")
    parser.add_argument("--moved", type=positive_int_list, default=[16, 64, 256, 1024],
                        help="blocks moved per step (all layers; 1024 moves more bytes than the last-level cache holds; "
                        "at most half of --num-blocks; default: 16,64,256,1024)")
    parser.add_argument("--patterns", type=names_from(PATTERNS, "patterns"), default=["scattered", "runs"],
                        help="which blocks move: scattered, runs (of 8) (default: scattered,runs)")
    parser.add_argument("--layout", choices=["discovered", "row", "transposed"], default="discovered",
                        help="the keys' layout in the cache: the one this vLLM's CPU attention uses (discovered at "
                        "start-up), or one given (default: discovered)")
    parser.add_argument("--num-blocks", type=positive_int, default=2048, help="blocks per layer cache (default: 2048)")
    parser.add_argument("--block-size", type=positive_int, default=32, help="tokens per KV block (default: 32)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="KV cache dtype (default: float32, what spanq's CPU engine runs)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads (default: 1; the 2 shared cores thrash with more)")
    parser.add_argument("--requests", type=positive_int, default=64,
                        help="planning: requests admitted in one step (default: 64)")
    parser.add_argument("--spans", type=positive_int, default=32, help="planning: spans per request (default: 32)")
    parser.add_argument("--blocks-per-span", type=positive_int, default=4, help="planning: blocks per span (default: 4)")
    parser.add_argument("--no-decode", action="store_true", help="skip measuring a decode step on the engine")
    args = parser.parse_args(list(argv))
    if args.moved and min(args.moved) > args.num_blocks // 2:
        parser.error(f"--moved {','.join(map(str, args.moved))}: every count is over half of --num-blocks "
                     f"{args.num_blocks} (the most one step moves here); nothing would be measured")  # fmt: skip
    return args


PATTERNS = ("scattered", "runs")


def main(argv: Sequence[str] = ()) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report = BenchReport("rerope", args)
    shapes = [KV_SHAPES[s] for s in args.shapes]
    half = args.num_blocks // 2  # the most blocks one step moves here
    settings = [(s, m, p) for s in shapes for m in args.moved if m <= half for p in args.patterns]
    layout = k_layout(args.layout, args.block_size, 64, args.dtype)
    error = check_relocation(layout)
    bar = progress(len(settings), "rerope", disable=args.no_progress)
    skipped = sorted({m for m in args.moved if m > half})
    if skipped:
        print(f"spanq bench rerope: --moved {','.join(map(str, skipped))} skipped: over half of --num-blocks "
              f"{args.num_blocks}", file=sys.stderr)  # fmt: skip
    for shape, moved, pattern in settings:
        lay = layout if shape.head_dim == 64 else k_layout(args.layout, args.block_size, shape.head_dim, args.dtype)
        report.rows.append(time_relocation(shape, lay, num_blocks=args.num_blocks, moved=moved, pattern=pattern,
                                           reps=args.reps, seed=args.seed, dtype=args.dtype))
        bar.update(1)
    bar.close()
    planning = time_planning(args.requests, args.spans, args.blocks_per_span, args.block_size, max(5, args.reps))
    decode = {} if args.no_decode else measure_decode_step(args.model, args.requests, 24)
    planning.update(decode)
    for key, step in decode.items():
        planning["share_of_" + key.replace("_s_", "_")] = planning["total_us_per_step"] * 1e-6 / step
    compiled = all(r["compiled"] for r in report.rows) if report.rows else False
    report.config.update({"layout": layout.kind, "max_abs_error_vs_rerope": error, "threads": args.threads,
                          "compiled": compiled})
    report.summary = {"planning": planning, "max_abs_error_vs_rerope": error}
    print(render_tables(report, args))
    report.write(plot(report.rows, args))
    report.print_files()
    return 0


def render_tables(report: BenchReport, args: argparse.Namespace) -> str:
    rows = [
        [r["shape"], f"{r['layers']}x{r['kv_heads']}x{r['head_dim']}", r["pattern"], r["moved_blocks"], r["tokens"],
         r["relocate_s"]["median"] * 1e3, r["relocate_tokens_per_ms"], r["relocate_tokens_per_ms_best"],
         r["copy_tokens_per_ms"], r["copy_gb_per_s"], r["fraction_of_copy"], r["fraction_of_copy_best"],
         r["inplace_tokens_per_ms"], r["fraction_of_inplace"], r["torch_tokens_per_ms"], r["torch_fraction_of_copy"]]
        for r in report.rows
    ]
    headers = ["shape", "LxHxD", "pattern", "moved", "tokens", "reloc ms", "tok/ms", "best tok/ms", "copy tok/ms",
               "copy GB/s", "x copy", "x copy best", "in-place tok/ms", "x in-place", "torch tok/ms", "torch x copy"]
    p = report.summary["planning"]
    plan_rows = [["CIDRA plan + admit", p["cidra_plan_us_per_step"]], ["position tracker", p["tracker_us_per_step"]],
                 ["total", p["total_us_per_step"]], ["duplicates planned", p["duplicates_per_step"]]]
    for key in dict.fromkeys(("decode_step_s_batch1", f"decode_step_s_batch{args.requests}")):  # (once at --requests 1)
        if key in p:
            plan_rows.append([f"decode step ({key.rsplit('batch', 1)[1]} seq), us", p[key] * 1e6])
            plan_rows.append(["  planning share of it", p["share_of_" + key.replace("_s_", "_")]])
    return (
        f"rerope: K relocation in place ({args.dtype}, layout {report.config['layout']}, "
        f"{'compiled op' if report.config['compiled'] else 'torch fallback: kernels unavailable'}; "
        f"torch = the plain torch fallback; {args.threads} torch thread(s), "
        f"{args.reps} reps; x copy = median of per-rep copy/relocate time ratios; in-place = gather and scatter "
        "back of the same scattered K blocks, no arithmetic; max error vs rerope_ "
        f"{report.summary['max_abs_error_vs_rerope']:.1e})\n"
        + format_table(headers, rows)
        + f"\n\nCIDRA planning: {args.requests} requests x {args.spans} spans x {args.blocks_per_span} blocks "
        "admitted in one step, microseconds\n"
        + format_table(["step", "value"], plan_rows)
    )


def plot(rows: list[dict[str, Any]], args: argparse.Namespace) -> Any:
    fig, (ax,) = new_figure(1, width=7.0)
    colors = {"tiny": "tab:blue", "tiny-4h": "tab:green", "smollm2": "tab:orange"}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for pattern, ls in (("scattered", "-"), ("runs", "--")):
            rs = [r for r in rows if r["shape"] == shape and r["pattern"] == pattern]
            if not rs:
                continue
            xs = [r["moved_blocks"] for r in rs]
            c = colors.get(shape, "k")
            ax.plot(xs, [r["relocate_tokens_per_ms"] for r in rs], ls=ls, marker="o", color=c,
                    label=f"relocate {shape} ({pattern})")
            if pattern == "scattered":
                ax.plot(xs, [r["copy_tokens_per_ms"] for r in rs], ls=":", marker="x", color=c,
                        label=f"copy of the same K bytes, {shape}")
                ax.plot(xs, [r["torch_tokens_per_ms"] for r in rs], ls="-.", marker=".", color=c, alpha=0.5,
                        label=f"torch fallback {shape} ({pattern})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("blocks moved per step")
    ax.set_ylabel("tokens per ms (all layers)")
    ax.set_title("ReRoPE relocation throughput vs a plain copy")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig
