"""`spanq bench tier`: the first query after an engine restart, over a corpus compiled into a span tier.

For each repetition, fresh documents (never seen before) are compiled into a span tier (`SpanEngine.compile`,
what `spanq prepare` runs), the engine is closed, and a new engine is started on the tier — a restart that finds
only the folder. Then, side by side:

- spans after a restart: the new engine's first query over the documents (their span KV loaded from the tier by
  the query's own request, then moved by ReRoPE);
- spans warm in memory: the same query on the engine that compiled them, right after (every span in its own cache,
  moved by ReRoPE) — the time a restart would cost nothing over;
- stock cold: stock vLLM (prefix caching on, in its own process with the plugin off) reads the documents for the
  first time, in the same query.

The restarted engine's next query (another order, another question) is recorded too: its spans are in memory then.

Each engine is warmed up first (one small query of its own), so first-call costs stay out of every column. The
load itself is timed inside the engine's step (reading, checking and copying the blocks) and set beside a plain
read of the same files, with the page cache warm (`--cold-disk` drops the tier's pages first, where the OS lets
it: then both read from disk).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BenchReport,
    base_parser,
    close_backend,
    faster,
    format_table,
    make_backend,
    make_documents,
    model_label,
    new_figure,
    only_with,
    positive_int,
    summarize,
    ttft_of,
    warm_up,
)
from benchmarks.rag import QUESTION, SECOND_QUESTION, rag_query

__all__ = ["main"]

GOAL_RESTART_VS_WARM = 2.0  # the restart's TTFT within 2x of warm in memory
PIN_PAIRS = (("pinned_without", "without"), ("pinned", "with"))  # --pin: each pinned engine, and it unpinned
CORPUS_MAX_MODEL_LEN = 2048  # --corpus: each engine's context
CORPUS_BLOCK_SIZE = 32  # (the engines' KV block, `EngineConfig`'s default)
GOAL_RESTART_VS_STOCK = 10.0  # and >= 10x faster than stock cold
GOAL_LOAD_SHARE = 0.5  # loading at >= 50% of a plain read of the same bytes


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = base_parser("tier", __doc__, model="default", reps=2)
    parser.add_argument("--docs", type=positive_int, default=8, help="documents per query (default: 8)")
    parser.add_argument("--doc-tokens", type=positive_int, default=512, help="tokens per document (default: 512)")
    parser.add_argument("--max-model-len", type=positive_int, default=8192, help="engine context length (default: 8192)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache per engine, GiB (default: 1)")
    parser.add_argument("--tier-dir", type=Path, default=None, metavar="DIR",
                        help="the tier's folder (default: a temporary one, removed at the end)")
    parser.add_argument("--cold-disk", action="store_true",
                        help="drop the tier files' pages from the page cache before each restart (posix_fadvise)")
    parser.add_argument("--corpus", action="store_true",
                        help="instead: a corpus larger than the engine's KV cache, Zipf-popular queries (bench bulk's "
                        "workload), one span engine with the corpus compiled into a tier and one without")
    parser.add_argument("--pool", type=positive_int, default=None, help="--corpus: fragments in the corpus (default: 400)")
    parser.add_argument("--frag-tokens", type=positive_int, default=None, help="--corpus: tokens per fragment (default: 128)")
    parser.add_argument("--queries", type=positive_int, default=None, help="--corpus: queries, one at a time (default: 64)")
    parser.add_argument("--k", type=positive_int, default=None, help="--corpus: fragments per query (default: 4)")
    parser.add_argument("--zipf", type=float, default=None, help="--corpus: Zipf exponent of popularity (default: 1.1)")
    parser.add_argument("--kv-blocks", type=positive_int, default=None,
                        help="--corpus: each engine's KV cache, in 32-token blocks (default: 160, a tenth of the "
                        "default corpus)")
    parser.add_argument("--pin", type=int, default=None, metavar="N",
                        help="--corpus: also each engine again with the N most popular fragments pinned in its KV "
                        "cache (SpanEngine.compile(..., pin=True)) before the queries (default: 0, none)")
    args = parser.parse_args(list(argv))
    only_with(parser, args, "--corpus", args.corpus, {"pool": 400, "frag_tokens": 128, "queries": 64, "k": 4,
                                                        "zipf": 1.1, "kv_blocks": 160, "pin": 0})
    if args.pin < 0:
        parser.error(f"--pin must be 0 or more, got {args.pin}")
    if args.corpus and args.kv_blocks * CORPUS_BLOCK_SIZE <= CORPUS_MAX_MODEL_LEN:  # (vLLM's start-up error named
        # options this command does not have)
        parser.error(f"--kv-blocks must be more than {CORPUS_MAX_MODEL_LEN // CORPUS_BLOCK_SIZE} (the engines' "
                     f"{CORPUS_MAX_MODEL_LEN}-token context in {CORPUS_BLOCK_SIZE}-token blocks), got {args.kv_blocks}")
    return args


def corpus_main(args: argparse.Namespace, report: BenchReport) -> int:
    """`--corpus`: the same Zipf workload on a span engine without a tier and on one whose tier holds the corpus."""
    from benchmarks.bulk import make_workload, workload_query
    from spanq_integrations import execute

    options = {"max_model_len": CORPUS_MAX_MODEL_LEN, "kv_blocks": args.kv_blocks, "max_num_seqs": 16}
    own_dir = args.tier_dir is None
    tier_dir = Path(tempfile.mkdtemp(prefix="spanq-tier-")) if own_dir else args.tier_dir
    try:
        variants = [("without", False), ("with", True)]
        if args.pin:
            variants += [("pinned_without", False), ("pinned", True)]
        for name, with_tier in variants:
            extra = {"tier_dir": str(tier_dir)} if with_tier else {}
            if name == "with":  # the corpus compiled first, on an engine of its own (then closed: a restart)
                compiler = make_backend(args.model, spans=True, **extra, **options)
                try:
                    w = make_workload(compiler.engine.tokenizer, pool=args.pool, queries=args.queries, k=args.k,
                                      frag_tokens=args.frag_tokens, zipf=args.zipf, seed=args.seed)
                    started = time.perf_counter()
                    compiled = asyncio.run(compiler.engine.compile(w.fragments))
                    report.config["compile"] = {**compiled, "seconds": time.perf_counter() - started}
                finally:
                    close_backend(compiler)
            backend = make_backend(args.model, spans=True, **extra, **options)
            try:
                warm_up(backend)
                w = make_workload(backend.engine.tokenizer, pool=args.pool, queries=args.queries, k=args.k,
                                  frag_tokens=args.frag_tokens, zipf=args.zipf, seed=args.seed)
                if name.startswith("pinned"):  # the pool is in popularity order: its first fragments are read most
                    report.config[f"pins_{name}"] = asyncio.run(backend.engine.compile(w.fragments[: args.pin], pin=True))
                    backend.engine.settle()
                for q in range(args.queries):
                    (call,) = execute(workload_query(w, q, session=0), backend).calls
                    report.rows.append({
                        "engine": name, "query": q, "ttft_s": ttft_of(call), "spans": call.extra.get("spans", 0),
                        "prepared_spans": call.prepared_spans, "deferred_spans": call.deferred_spans,
                        "mode": call.extra.get("cold_spans"), "cached_tokens": call.cached_tokens,
                        "prompt_tokens": call.prompt_tokens,
                    })
                    backend.engine.settle()  # deferred prepares done between queries, as an idle engine does them
                report.config[f"tier_{name}"] = backend.engine.tier_stats()
            finally:
                close_backend(backend)
    finally:
        if own_dir:
            shutil.rmtree(tier_dir, ignore_errors=True)
    summary: dict[str, Any] = {}
    names = [name for name, _ in variants]
    for name in names:
        rows = [r for r in report.rows if r["engine"] == name]
        spans = sum(r["spans"] for r in rows)
        missed = sum(r["prepared_spans"] + r["deferred_spans"] for r in rows)
        summary[name] = {"span_hit_rate": 1 - missed / spans if spans else None,
                         "mean_ttft_s": sum(r["ttft_s"] for r in rows) / len(rows),
                         "modes": {m: sum(r["mode"] == m for r in rows) for m in sorted({str(r["mode"]) for r in rows})}}
    summary["mean_ttft_ratio"] = summary["without"]["mean_ttft_s"] / summary["with"]["mean_ttft_s"]
    if "pinned" in summary:
        # each pinned engine's mean TTFT against the same engine unpinned (its time over the pinned one's)
        summary["pinned_speedup"] = {name: summary[against]["mean_ttft_s"] / summary[name]["mean_ttft_s"]
                                     for name, against in PIN_PAIRS}
    report.summary = summary
    corpus_blocks = args.pool * -(-args.frag_tokens // 32)
    print(f"{model_label(args.model)}: {args.pool} fragments x {args.frag_tokens} tokens (~{corpus_blocks} blocks) "
          f"against a KV cache of {args.kv_blocks} blocks; {args.queries} queries of {args.k}, Zipf {args.zipf}")
    label = {"without": "without the corpus in a tier", "with": "with the corpus in a tier",
             "pinned_without": f"no tier, the {args.pin} most popular pinned in its cache",
             "pinned": f"the tier, and the {args.pin} most popular pinned in its cache"}
    print(format_table(["span engine", "span hit rate", "mean TTFT (s)", "how its calls read"], [
        [label[name], f"{summary[name]['span_hit_rate']:.3f}", f"{summary[name]['mean_ttft_s']:.3f}",
         ", ".join(f"{m} {n}" for m, n in summary[name]["modes"].items())] for name in names]))
    print(f"with the tier: span hit rate {summary['with']['span_hit_rate']:.3f} (goal >= 0.9), mean TTFT "
          f"{faster(summary['mean_ttft_ratio'])} than without (goal >= 3x faster)")
    if "pinned" in summary:
        for name, against in PIN_PAIRS:
            pins = report.config[f"pins_{name}"]
            print(f"{label[name]}: {pins['pinned_blocks']} blocks pinned ({pins['pin_refused']} refused past half the "
                  f"cache, {pins['pin_missing']} evicted first); mean TTFT {faster(summary['pinned_speedup'][name])} "
                  f"than {label[against]}")
    report.label = f"{model_label(args.model)}-corpus"
    report.write()
    report.print_files()
    return 0


def drop_pages(folder: Path) -> bool:
    """Ask the OS to drop the page cache of every file under `folder`; False where it cannot be asked."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in folder.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def plain_read(folder: Path) -> tuple[int, float]:
    """Bytes and seconds to read every block file under `folder` (what loading them costs at least)."""
    started, total = time.perf_counter(), 0
    for path in folder.rglob("*.kv"):
        total += len(path.read_bytes())
    return total, time.perf_counter() - started


def main(argv: Sequence[str] = ()) -> int:
    from benchmarks.process_backend import ProcessBackend
    from spanq_integrations import execute

    args = parse_args(argv)
    report = BenchReport("tier", args)
    if args.corpus:
        return corpus_main(args, report)
    options = {"max_model_len": args.max_model_len, "kv_cache_gib": args.kv_cache_gib, "max_num_seqs": 16}
    own_dir = args.tier_dir is None
    tier_dir = Path(tempfile.mkdtemp(prefix="spanq-tier-")) if own_dir else args.tier_dir
    stock = ProcessBackend(args.model, spans=False, plugin=False, **options)
    try:
        warm_up(stock)
        for rep in range(args.reps):
            compiler = make_backend(args.model, spans=True, tier_dir=str(tier_dir), **options)
            try:
                warm_up(compiler)
                tokenizer = compiler.engine.tokenizer
                docs = make_documents(tokenizer, args.docs, args.doc_tokens, seed=args.seed, start=rep * args.docs)
                order = list(reversed(range(args.docs)))
                started = time.perf_counter()
                compiled = asyncio.run(compiler.engine.compile(docs))
                compile_s = time.perf_counter() - started
                (warm,) = execute(rag_query(docs, order, QUESTION), compiler).calls  # the same query, spans in memory
            finally:
                close_backend(compiler)
            dropped = drop_pages(tier_dir) if args.cold_disk else False
            started = time.perf_counter()
            spans = make_backend(args.model, spans=True, tier_dir=str(tier_dir), **options)
            try:
                start_s = time.perf_counter() - started
                warm_up(spans)  # first-call costs out, as on the other engines (its own small documents)
                before = spans.engine.tier_stats()
                (restart,) = execute(rag_query(docs, order, QUESTION), spans).calls
                loaded = spans.engine.tier_stats()
                spans.engine.settle()
                (after,) = execute(rag_query(docs, list(range(args.docs)), SECOND_QUESTION), spans).calls
            finally:
                close_backend(spans)
            (cold,) = execute(rag_query(docs, order, QUESTION), stock).calls
            read_bytes, read_s = plain_read(tier_dir / Path(loaded["dir"]).name)
            load = {k: loaded[k] - before[k] for k in ("loads", "loaded_blocks", "failed_loads", "bytes_read", "load_seconds")}
            report.rows.append({
                "rep": rep, "docs": args.docs, "doc_tokens": args.doc_tokens, "compile": compiled, "compile_s": compile_s,
                "engine_start_s": start_s, "cold_disk": dropped,
                "restart_ttft_s": ttft_of(restart), "warm_ttft_s": ttft_of(warm), "stock_cold_ttft_s": ttft_of(cold),
                "restart_prepared_spans": restart.prepared_spans, "restart_prepared_tokens": restart.prepared_tokens,
                "restart_cached_tokens": restart.cached_tokens, "warm_prepared_spans": warm.prepared_spans,
                "restart_mode": restart.extra.get("cold_spans"), "load": load,
                "next_query_ttft_s": ttft_of(after), "next_query_mode": after.extra.get("cold_spans"),
                "plain_read_bytes": read_bytes, "plain_read_s": read_s,
            })
            print(f"rep {rep}: restart {ttft_of(restart):.3f} s (prepared {restart.prepared_spans} spans, "
                  f"{load['loaded_blocks']} blocks loaded in {load['load_seconds']:.3f} s), warm {ttft_of(warm):.3f} s, "
                  f"stock cold {ttft_of(cold):.3f} s", flush=True)
    finally:
        close_backend(stock)
        if own_dir:
            shutil.rmtree(tier_dir, ignore_errors=True)
    report.summary = summarize_rows(report.rows)
    print(render(report.summary, args))
    report.write(plot(report.summary, args))
    report.print_files()
    return 0


def summarize_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    restart = [r["restart_ttft_s"] for r in rows]
    warm = [r["warm_ttft_s"] for r in rows]
    cold = [r["stock_cold_ttft_s"] for r in rows]
    load_rate = [r["load"]["bytes_read"] / r["load"]["load_seconds"] for r in rows if r["load"]["load_seconds"] > 0]
    read_rate = [r["plain_read_bytes"] / r["plain_read_s"] for r in rows if r["plain_read_s"] > 0]
    return {
        "restart_ttft_s": summarize(restart),
        "warm_ttft_s": summarize(warm),
        "stock_cold_ttft_s": summarize(cold),
        # medians of per-repetition ratios
        "restart_over_warm": summarize([r / w for r, w in zip(restart, warm)])["median"],
        "stock_cold_over_restart": summarize([c / r for r, c in zip(restart, cold)])["median"],
        "load_mb_s": summarize(load_rate)["median"] / 1e6 if load_rate else None,
        "plain_read_mb_s": summarize(read_rate)["median"] / 1e6 if read_rate else None,
        "restart_prepared_spans": max(r["restart_prepared_spans"] for r in rows),
    }


def render(summary: dict[str, Any], args: argparse.Namespace) -> str:
    s = summary
    rows = [
        ["spans after a restart (from the tier)", f"{s['restart_ttft_s']['median']:.3f}", "1.00x"],
        ["spans warm in memory", f"{s['warm_ttft_s']['median']:.3f}", f"{1 / s['restart_over_warm']:.2f}x"],
        ["stock cold", f"{s['stock_cold_ttft_s']['median']:.3f}", f"{s['stock_cold_over_restart']:.2f}x"],
    ]
    table = format_table(["TTFT, median of reps", "s", "x the restart's time"], rows)
    share = (s["load_mb_s"] / s["plain_read_mb_s"]) if s["load_mb_s"] and s["plain_read_mb_s"] else float("nan")
    return (
        f"{model_label(args.model)}, {args.docs} documents x {args.doc_tokens} tokens, {args.reps} restarts\n{table}\n"
        f"restart / warm: {s['restart_over_warm']:.2f}x (goal <= {GOAL_RESTART_VS_WARM:.0f}x); stock cold / restart: "
        f"{s['stock_cold_over_restart']:.1f}x (goal >= {GOAL_RESTART_VS_STOCK:.0f}x); spans computed after the "
        f"restart: {s['restart_prepared_spans']}\n"
        f"loading: {s['load_mb_s'] or 0:.0f} MB/s in the engine's step, a plain read of the same files "
        f"{s['plain_read_mb_s'] or 0:.0f} MB/s ({share:.0%}; goal >= {GOAL_LOAD_SHARE:.0%})"
    )


def plot(summary: dict[str, Any], args: argparse.Namespace) -> Any:
    fig, (ax,) = new_figure()
    names = ["stock cold", "spans after\na restart", "spans warm"]
    values = [summary["stock_cold_ttft_s"]["median"], summary["restart_ttft_s"]["median"], summary["warm_ttft_s"]["median"]]
    ax.bar(names, values, color=["#888888", "#2a7ab9", "#7fb8e0"])
    ax.set_ylabel("time to first token (s), median")
    ax.set_title(f"{model_label(args.model)}: {args.docs} x {args.doc_tokens} tokens, first query after a restart")
    return fig
