"""`spanq bench rag`: time to first token of a RAG prompt against the number of documents it reads.

For each document count n and repetition, n fresh documents (never seen before) are read by one question:

- stock cold: stock vLLM (prefix caching on) reads them for the first time, in order d1..dn;
- spans cold: the span-aware engine reads them for the first time (each document prefilled on its own, then
  the question over all of them);
- stock reordered: stock vLLM reads the same documents again in reverse order, for another question (its prefix
  cache holds the first order, so only the system prompt hits);
- spans warm: the span-aware engine is given them again in reverse order, for another question (every span hits;
  the engine reads a set of spans in one order whatever order it is given, so they sit where the cold query left
  them: nothing is moved, where a `keep_span_order` engine moves them by ReRoPE);
- stock canonical: what a careful user builds on stock vLLM — the reverse-order retrieval sorted back into a
  canonical order (by document id) before the prompt is built, so the same set hits the prefix cache; the other
  question after it is computed;
- stock same: stock vLLM reads the first prompt again, unchanged, the first question too: its best case,
  everything cached (the floor; a response cache would serve it);
- stock subset / spans subset (3 documents or more): another retrieval that finds all but the first of them, in
  another order (d2, dn, dn-1, .., d3), for a fourth question, as a RAG app's next query over an overlapping result
  does. Stock's prefix cache holds no prompt that starts with d2: it computes all of it. The span engine never read
  this set in context: it reads the documents as cached spans at their new positions, or, where that would compute
  nearly as much as the stock prompt, reads the stock prompt (`SpanGenerator.layout`).

The second pass asks another question, as a RAG app's next query does when its retriever finds documents it found
before: asked the first question again, stock canonical would be stock same. With one document, reversed is the
canonical order, so stock canonical asks a third question (the second one's prompt is cached whole by then).

They run one after another, so they see the same machine load; stock runs in its own process with the plugin
off. Before each measurement the engine measured serves one plain 1-token request (`ready`): each measurement then
starts from a process that has just served a request, whichever process ran before it (without it, a pair's
ratio moved by 10–15% with the order of the pair: `--no-ready`, `--swap-order`).

`--question-first` lays the prompt out as LangChain hub's rag prompt does (one user turn, the question before the
documents): with another question on the second pass, what stock vLLM's prefix cache cannot reuse at all, and
spans reuse under the default anchor policy ("template").
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.common import (
    BenchReport,
    add_recompute_flag,
    base_parser,
    engine_options_of,
    engine_pair,
    faster,
    format_table,
    make_documents,
    model_label,
    new_figure,
    only_with,
    paired_speedup,
    positive_int,
    positive_int_list,
    progress,
    ready,
    settle,
    summarize,
    ttft_of,
)
from spanq_backend.serving.cluster_options import positive_float

__all__ = ["MODES", "main"]

MODES = ("stock_cold", "spans_cold", "stock_reordered", "spans_warm", "stock_canonical", "stock_same", "stock_subset",
         "spans_subset")
SUBSET_MIN_DOCS = 3  # with fewer, every subset in any order starts with a document some earlier prompt started with
SYSTEM = "You are a helpful assistant. Answer the question using only the documents."
QUESTION = "Which of the documents mentions a lantern near the harbor? Answer with its number."
SECOND_QUESTION = "Which of the documents names a bridge over the river? Answer with its number."
THIRD_QUESTION = "Which of the documents describes a market in the square? Answer with its number."
FOURTH_QUESTION = "Which of the documents tells of a well behind the mill? Answer with its number."
GOAL_DOCS, GOAL_SPEEDUP = 8, 10.0  # the target on the tiny model: 8 docs x 512 tokens, warm >= 10x stock


def rag_query(
    docs: Sequence[str], order: Sequence[int], question: str = QUESTION, question_first: bool = False
) -> Any:
    from spanq_integrations import cross, fragment, generate, plus, system, user

    documents = plus(*[fragment(docs[i], id=f"doc{i}") for i in order])
    if question_first:
        prompt = cross(user(f"{SYSTEM}\nQuestion: {question}\nContext:"), documents)
    else:
        prompt = cross(system(SYSTEM), documents, user(question))
    return generate(prompt, max_tokens=1, temperature=0.0)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = base_parser("rag", __doc__, model="tiny", reps=3)
    parser.add_argument(
        "--docs", type=positive_int_list, default=None,
        help="document counts (default: 1,2,4,8,16,32 on tiny, 1,2,4,8,16 otherwise; counts whose prompt does "
        "not fit --max-model-len are skipped)",
    )
    parser.add_argument("--doc-tokens", type=positive_int, default=512, help="tokens per document (default: 512)")
    parser.add_argument("--max-model-len", type=positive_int, default=8192, help="engine context length (default: 8192)")
    parser.add_argument("--kv-cache-gib", type=positive_float, default=1.0, help="KV cache per engine, GiB (default: 1)")
    parser.add_argument("--question-first", action="store_true",
                        help="the question before the documents, and another question on the second pass")
    parser.add_argument("--cold-spans", choices=("isolate", "context", "auto"), default="auto",
                        help="how the span engine computes documents it has not cached (EngineConfig.cold_spans; "
                        "default: auto, the engine's default)")
    add_recompute_flag(parser)
    parser.add_argument("--swap-order", action="store_true",
                        help="measure each side-by-side pair in the other order (spans cold before stock cold, stock "
                        "canonical before spans warm): a check that the order does not move the ratios")
    parser.add_argument("--no-ready", action="store_true",
                        help="no plain 1-token request to an engine right before each measurement of it (what "
                        "makes the order of a pair not matter: docs/benchmarks.md)")
    parser.add_argument("--grid", action="store_true",
                        help="every document count x every document size of --doc-tokens-list (default 64,128,256,512), "
                        "with a heat map of each speedup")
    parser.add_argument("--doc-tokens-list", type=positive_int_list, default=None, metavar="N,N",
                        help="--grid: the document sizes (default 64,128,256,512)")
    args = parser.parse_args(list(argv))
    only_with(parser, args, "--grid", args.grid, {"doc_tokens_list": [64, 128, 256, 512]})
    if min(args.docs or [1]) * (min(args.doc_tokens_list) if args.grid else args.doc_tokens) >= args.max_model_len:
        parser.error(f"no setting fits --max-model-len {args.max_model_len}: the fewest documents' tokens alone fill "
                     "it (lower --docs or --doc-tokens, or raise --max-model-len)")  # (found after both engines started)
    if args.docs is None:
        args.docs = [1, 2, 4, 8, 16] if args.grid or args.model != "tiny" else [1, 2, 4, 8, 16, 32]
    if not args.grid:
        args.doc_tokens_list = [args.doc_tokens]
    return args


def _span_engine_stats(backend: Any) -> dict[str, float]:
    """The span engine's own counters (relocation and hashing host time), in this process."""
    from spanq_backend import vllm_integration

    s = vllm_integration.stats()
    return {"relocation_s": s["relocation_seconds"], "hashing_s": s["hashing_seconds"], "steps": backend.engine.steps}


def main(argv: Sequence[str] = (), *, backends: tuple[Any, Any] | None = None) -> int:
    """Run the benchmark; `backends` = (stock, spans) to reuse engines instead of starting two."""
    from spanq_integrations import execute
    from spanq_integrations.query.errors import ContextLengthError

    args = parse_args(argv)
    report = BenchReport("rag", args)
    options = engine_options_of(args, max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib, max_num_seqs=16)
    if backends is None:
        options["cold_spans"] = args.cold_spans
    with engine_pair(args.model, backends=backends, **options) as (stock, spans):
        tokenizer = spans.engine.tokenizer
        cells, skipped = [], []
        for tokens in args.doc_tokens_list:
            for n in sorted(set(args.docs)):
                probe = make_documents(tokenizer, n, tokens, seed=args.seed, start=10**6)
                try:
                    spans.engine.lower(rag_query(probe, range(n)))
                    cells.append((n, tokens))
                except ContextLengthError:
                    skipped.append((n, tokens))
        if skipped:
            print(f"skipped (documents, tokens) {skipped}: they do not fit {args.max_model_len} tokens "
                  "(lower --doc-tokens or raise --max-model-len)")
        if not cells:  # (an empty table failed to print: "TypeError: 'int' object is not iterable")
            print(f"spanq bench rag: error: no setting fits --max-model-len {args.max_model_len}", file=sys.stderr)
            return 2
        per_cell = [len(MODES) - (2 if n < SUBSET_MIN_DOCS else 0) for n, _ in cells]
        bar = progress(sum(per_cell) * args.reps, "rag", disable=args.no_progress)
        next_doc = 0
        for n, tokens in cells:
            for rep in range(args.reps):
                docs = make_documents(tokenizer, n, tokens, seed=args.seed, start=next_doc)
                next_doc += n
                first, again = list(range(n)), list(reversed(range(n)))
                later = SECOND_QUESTION
                plan = (("stock_cold", stock, first, QUESTION), ("spans_cold", spans, first, QUESTION),
                        ("stock_reordered", stock, again, later), ("spans_warm", spans, again, later),
                        ("stock_canonical", stock, sorted(again), THIRD_QUESTION if n == 1 else later),
                        ("stock_same", stock, first, QUESTION))
                if n >= SUBSET_MIN_DOCS:
                    subset = [1, *range(n - 1, 1, -1)]
                    plan += (("stock_subset", stock, subset, FOURTH_QUESTION), ("spans_subset", spans, subset, FOURTH_QUESTION))
                if args.swap_order:  # the other order of each side-by-side pair
                    plan = (plan[1], plan[0], plan[2], plan[4], plan[3], *plan[5:6], *plan[6:][::-1])
                for mode, backend, order, question in plan:
                    # What the span engine does between queries (background prepares, documents read in context
                    # when idle) is done before every measurement, stock's too: on a shared CPU it would slow them.
                    settle(spans)
                    if not args.no_ready:
                        ready(backend)
                    if backend is spans:
                        before = _span_engine_stats(spans)
                    (call,) = execute(rag_query(docs, order, question, args.question_first), backend).calls
                    row = {
                        "docs": n, "doc_tokens_target": tokens, "rep": rep, "mode": mode, "ttft_s": ttft_of(call),
                        "prompt_tokens": call.prompt_tokens, "cached_tokens": call.cached_tokens,
                        "padded_tokens": call.padded_tokens, "prepared_spans": call.prepared_spans,
                        "deferred_spans": call.deferred_spans,
                        "prepared_tokens": call.prepared_tokens,
                        "doc_tokens": [len(tokenizer.encode(d, add_special_tokens=False)) for d in docs],
                    }
                    if backend is spans:
                        after = _span_engine_stats(spans)
                        row["phases_s"] = call.extra.get("phases_s", {})
                        row["engine"] = {k: after[k] - before[k] for k in after}
                    report.rows.append(row)
                    bar.update(1)
        bar.close()

    report.config.update({"cold_spans": getattr(spans.engine.generator, "cold_spans", None),
                          "recompute": str(getattr(spans.engine.generator, "default_recompute", None)), "cells": cells, "skipped_cells": skipped, "modes": list(MODES), "question": QUESTION,
                          "question_first": args.question_first,
                          "ready": not args.no_ready, "swap_order": args.swap_order})
    report.summary = summarize_cells(report.rows, cells)
    print(render_table(report.summary, args))
    print()
    print(render_profile(report.summary, args))
    goal = report.summary.get(cell_key(GOAL_DOCS, args.doc_tokens))
    if goal is not None and not args.grid:
        print(f"\n{GOAL_DOCS} documents x {args.doc_tokens} tokens on {model_label(args.model)}: spans warm is "
              f"{faster(goal['speedup_warm_vs_stock_reordered'], 1)} to first token than stock reordered "
              f"(issue goal on tiny: >= {GOAL_SPEEDUP:.0f}x)")
    report.write(plot_grid(report.summary, args) if args.grid else plot(report.summary, args))
    report.print_files()
    return 0


def cell_key(n: int, tokens: int) -> str:
    return f"{n}x{tokens}"


def summarize_cells(rows: list[dict[str, Any]], cells: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """Per (documents, tokens) cell: `summarize_rows`' entry."""
    out = {}
    for n, tokens in cells:
        at = [r for r in rows if r["docs"] == n and r.get("doc_tokens_target", tokens) == tokens]
        entry = summarize_rows(at, [n])[str(n)]
        entry.update({"docs": n, "doc_tokens": tokens})
        entry["profile"] = profile_of(at)
        out[cell_key(n, tokens)] = entry
    return out


PHASES = ("lower", "prepare", "submit", "answer")


def profile_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per span mode: the median time of each phase of the call (`CallMetrics.extra["phases_s"]`), and of the
    engine's relocation and span hashing inside it, with the TTFT they add up to."""
    out = {}
    for mode in ("spans_cold", "spans_warm", "spans_subset"):
        at = [r for r in rows if r["mode"] == mode and r.get("phases_s")]
        if not at:
            continue
        entry = {p: summarize([r["phases_s"].get(p) for r in at])["median"] for p in PHASES}
        entry.update({k: summarize([r["engine"][k] for r in at])["median"] for k in ("relocation_s", "hashing_s", "steps")})
        entry["ttft_s"] = summarize([r["ttft_s"] for r in at])["median"]
        entry["prepared_tokens"] = summarize([r["prepared_tokens"] for r in at])["median"]
        out[mode] = entry
    return out


def summarize_rows(rows: list[dict[str, Any]], sizes: Sequence[int]) -> dict[str, Any]:
    """Per document count: each mode's TTFT statistics, and speedups as medians of per-repetition ratios."""
    out: dict[str, Any] = {}
    for n in sizes:
        at = [r for r in rows if r["docs"] == n]
        ttft = {m: {r["rep"]: r["ttft_s"] for r in at if r["mode"] == m} for m in MODES}
        entry: dict[str, Any] = {m: summarize(list(ttft[m].values())) for m in MODES}

        entry["speedup_warm_vs_stock_reordered"] = paired_speedup(ttft["stock_reordered"], ttft["spans_warm"])
        entry["speedup_cold_vs_stock_cold"] = paired_speedup(ttft["stock_cold"], ttft["spans_cold"])
        entry["speedup_cold_vs_stock_reordered"] = paired_speedup(ttft["stock_reordered"], ttft["spans_cold"])
        entry["speedup_warm_vs_stock_canonical"] = paired_speedup(ttft["stock_canonical"], ttft["spans_warm"])
        entry["speedup_warm_vs_stock_same"] = paired_speedup(ttft["stock_same"], ttft["spans_warm"])
        entry["speedup_subset_vs_stock_subset"] = paired_speedup(ttft["stock_subset"], ttft["spans_subset"])
        warm = [r for r in at if r["mode"] == "spans_warm"]
        stock = [r for r in at if r["mode"] == "stock_reordered"]
        entry["prompt_tokens_spans"] = warm[0]["prompt_tokens"] if warm else None
        entry["prompt_tokens_stock"] = stock[0]["prompt_tokens"] if stock else None
        entry["padded_tokens"] = warm[0]["padded_tokens"] if warm else None
        entry["warm_cached_fraction"] = (
            sum(r["cached_tokens"] for r in warm) / max(1, sum(r["prompt_tokens"] for r in warm)) if warm else None
        )
        entry["stock_reordered_cached_fraction"] = (
            sum(r["cached_tokens"] for r in stock) / max(1, sum(r["prompt_tokens"] for r in stock)) if stock else None
        )
        out[str(n)] = entry
    return out


def _ms_share(x: Any, total: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1000:.1f} ({x / total:.0%})"


def render_profile(summary: dict[str, Any], args: argparse.Namespace) -> str:
    """Where the span engine's time to first token goes, per cell and mode (ms, medians; share of the TTFT)."""
    rows = []
    for key, e in summary.items():
        for mode, p in e.get("profile", {}).items():
            ttft = p["ttft_s"] or float("nan")
            rows.append([key, mode.removeprefix("spans_"), p["ttft_s"] * 1000,
                         *(_ms_share(p[k], ttft) for k in (*PHASES, "relocation_s", "hashing_s")),
                         p["steps"], p["prepared_tokens"]])
    headers = ["docs x tokens", "spans", "TTFT ms", "lower", "prepare round", "submit", "answer round",
               "of which relocation", "hashing (engine core)", "engine steps", "prepared tokens"]
    return (f"profile of the span engine's TTFT on {model_label(args.model)} (ms, median; share of the TTFT)\n"
            + format_table(headers, rows, left=2))


def render_table(summary: dict[str, Any], args: argparse.Namespace) -> str:
    ms = 1000.0
    rows = []
    for n, e in summary.items():
        rows.append([
            n, e["prompt_tokens_stock"], e["prompt_tokens_spans"],
            e["stock_cold"]["median"] * ms, e["stock_reordered"]["median"] * ms, e["stock_reordered"]["p90"] * ms,
            e["spans_cold"]["median"] * ms, e["spans_cold"]["p90"] * ms,
            e["spans_warm"]["median"] * ms, e["spans_warm"]["p90"] * ms,
            e["stock_canonical"]["median"] * ms, e["stock_same"]["median"] * ms,
            e["speedup_warm_vs_stock_reordered"], e["speedup_cold_vs_stock_cold"],
            e["speedup_warm_vs_stock_canonical"], e["speedup_warm_vs_stock_same"],
            e["stock_subset"]["median"] * ms, e["spans_subset"]["median"] * ms, e["speedup_subset_vs_stock_subset"],
        ])
    headers = ["docs x tok", "tok stock", "tok spans", "stock cold", "stock reord", "p90", "spans cold", "p90",
               "spans warm", "p90", "stock canon", "stock same", "warm x", "cold x", "x canon", "x same",
               "stock subset", "spans subset", "subset x"]
    title = (f"rag on {model_label(args.model)}: TTFT in ms (median, p90 over {args.reps} reps), "
             f"documents x tokens; speedups = median of per-rep ratios (warm vs stock reordered, "
             "cold vs stock cold, warm vs stock canonical order, warm vs stock's best case: the same prompt again; "
             "an overlapping subset in another order, spans vs stock)")
    return title + "\n" + format_table(headers, rows)


def plot_grid(summary: dict[str, Any], args: argparse.Namespace) -> Any:
    """One heat map per speedup: documents (rows) x tokens per document (columns), 1.0 = as fast as stock."""
    ratios = (("speedup_cold_vs_stock_cold", "spans cold vs stock cold"),
              ("speedup_warm_vs_stock_canonical", "spans warm vs stock canonical"),
              ("speedup_warm_vs_stock_reordered", "spans warm vs stock reordered"),
              ("speedup_subset_vs_stock_subset", "spans subset vs stock subset"))
    fig, axes = new_figure(len(ratios), width=4.2)
    docs = sorted({e["docs"] for e in summary.values()})
    toks = sorted({e["doc_tokens"] for e in summary.values()})
    for ax, (key, title) in zip(axes, ratios):
        grid = [[summary.get(cell_key(n, t), {}).get(key, float("nan")) for t in toks] for n in docs]
        import numpy as np

        values = np.array(grid, dtype=float)
        im = ax.imshow(np.log2(values), cmap="RdYlGn", vmin=-2, vmax=2, origin="lower")
        for i in range(len(docs)):
            for j in range(len(toks)):
                v = values[i, j]
                ax.text(j, i, "-" if math.isnan(v) else f"{v:.2g}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(toks)), [str(t) for t in toks])
        ax.set_yticks(range(len(docs)), [str(n) for n in docs])
        ax.set_xlabel("tokens per document")
        ax.set_ylabel("documents")
        ax.set_title(f"{title}, {model_label(args.model)}", fontsize=9)
    fig.colorbar(im, ax=list(axes), shrink=0.7, label="log2 speedup (green: spans faster)")
    return fig


def plot(summary: dict[str, Any], args: argparse.Namespace) -> Any:
    fig, (ax, ax2) = new_figure(2, width=5.5)
    summary = {str(e["docs"]): e for e in summary.values()}
    sizes = [int(n) for n in summary]
    styles = {"stock_cold": ("stock, cold", "tab:gray", "--"), "stock_reordered": ("stock, reordered", "k", "-"),
              "stock_canonical": ("stock, canonical order", "tab:green", ":"),
              "stock_same": ("stock, same prompt (floor)", "tab:purple", ":"),
              "spans_cold": ("spans, cold", "tab:orange", "-"), "spans_warm": ("spans, warm", "tab:blue", "-")}
    for mode, (label, color, ls) in styles.items():
        med = [summary[str(n)][mode]["median"] * 1000 for n in sizes]
        p90 = [summary[str(n)][mode]["p90"] * 1000 for n in sizes]
        ax.plot(sizes, med, marker="o", color=color, ls=ls, label=label)
        ax.fill_between(sizes, med, p90, color=color, alpha=0.15)
    _doc_axis(ax, sizes)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, ms (median; band to p90)")
    ax.set_title(f"RAG TTFT, {model_label(args.model)}, {args.doc_tokens}-token docs")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    ax2.plot(sizes, [summary[str(n)]["speedup_warm_vs_stock_reordered"] for n in sizes], marker="o",
             color="tab:blue", label="spans warm vs stock reordered")
    ax2.plot(sizes, [summary[str(n)]["speedup_cold_vs_stock_cold"] for n in sizes], marker="o",
             color="tab:orange", label="spans cold vs stock cold")
    ax2.axhline(1.0, color="k", lw=0.8)
    _doc_axis(ax2, sizes)
    ax2.set_yscale("log")
    ax2.set_ylabel("TTFT speedup (median of per-rep ratios)")
    ax2.set_title("speedup over stock vLLM")
    ax2.legend()
    ax2.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def _doc_axis(ax: Any, sizes: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes), [str(n) for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("documents")
