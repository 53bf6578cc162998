"""`spanq bench bulk`: a RAG batch whose queries share fragments — bulk size, temporal-locality order, hit rate.

The workload (deterministic for a seed): a pool of `--pool` fragments of about `--frag-tokens` tokens each;
fragment i has popularity proportional to 1/(i+1)^s (Zipf, s = `--zipf`), so a few fragments are read by many
queries and most by few. Each of `--queries` queries reads `--k` distinct fragments drawn by popularity
(without replacement, in the order drawn) and asks its own question. Queries arrive in that order.

The workload is submitted in bulks of B queries (each bulk one `plus` of queries, run concurrently by the
executor): B = 1 (one query at a time), the `--bulk` sizes, and 0 = the whole workload at once. Within a bulk
the queries run in arrival order, or in the order of the optimizer's `bulk_order` rule (queries that share
fragments next to each other). The KV cache is capped at `--kv-blocks` blocks so that fragments are evicted
and the order matters. Every setting runs from an empty prefix cache (reset before each run) on a stock engine,
on a stock engine fed what a careful user would build on it (each query's fragments sorted into one canonical
order, by pool index — popular fragments first — so queries that share leading fragments share a prefix), and on
the span-aware engine; each run also has its own system prompt. Stock runs in its own process with the plugin
off.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.common import (
    BenchReport,
    add_recompute_flag,
    base_parser,
    engine_options_of,
    engine_pair,
    format_table,
    int_list,
    make_documents,
    model_label,
    new_figure,
    positive_int,
    progress,
    reset_cache,
    settle,
    summarize,
    ttft_of,
)

__all__ = ["Workload", "main", "make_workload"]

SYSTEM = "Answer the question from the fragments. Session {session:03d}."


@dataclass(frozen=True)
class Workload:
    fragments: list[str]
    queries: list[list[int]]  # per query: the fragment indices it reads, in retrieval order
    questions: list[str]

    def unique_fragments(self) -> int:
        return len({f for q in self.queries for f in q})


def make_workload(
    tokenizer: Any, *, pool: int, queries: int, k: int, frag_tokens: int, zipf: float, seed: int
) -> Workload:
    """The fragment pool and the queries over it (see the module docstring)."""
    fragments = make_documents(tokenizer, pool, frag_tokens, seed=seed, title="Fragment")
    rng = random.Random(f"spanq-bulk:{seed}")
    weights = [1.0 / (i + 1) ** zipf for i in range(pool)]
    picks: list[list[int]] = []
    for _ in range(queries):
        chosen: list[int] = []
        while len(chosen) < min(k, pool):
            (i,) = rng.choices(range(pool), weights=weights)
            if i not in chosen:
                chosen.append(i)
        picks.append(chosen)
    questions = [f"Question {q}: which fragment is about a {rng.choice(('river', 'tower', 'lantern', 'harbor'))}?"
                 for q in range(queries)]
    return Workload(fragments, picks, questions)


def workload_query(w: Workload, q: int, session: int, canonical: bool = False) -> Any:
    from spanq_integrations import cross, fragment, generate, plus, system, user

    picks = sorted(w.queries[q]) if canonical else w.queries[q]
    frags = [fragment(w.fragments[i], id=f"frag{i}") for i in picks]
    return generate(
        cross(system(SYSTEM.format(session=session)), plus(*frags), user(w.questions[q])), max_tokens=1,
        temperature=0.0,
    )


def bulks(w: Workload, size: int, order: str, session: int, canonical: bool = False) -> list[list[Any]]:
    """The workload's queries cut into bulks of `size` (0: one bulk), each in arrival or locality order."""
    from spanq_integrations import Plus
    from spanq_integrations.optimizer import OptimizerContext, bulk_order

    n = len(w.queries)
    size = size or n
    out = []
    for lo in range(0, n, size):
        batch = [workload_query(w, q, session, canonical) for q in range(lo, min(n, lo + size))]
        if order == "locality" and len(batch) > 1:
            batch = list(bulk_order(Plus(children=tuple(batch)), OptimizerContext(bulk_order=True)).children)
        out.append(batch)
    return out


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = base_parser("bulk", __doc__, model="tiny", reps=1)
    parser.add_argument("--queries", type=positive_int, default=256, help="queries in the workload (default: 256)")
    parser.add_argument("--pool", type=positive_int, default=1000, help="fragments in the pool (default: 1000)")
    parser.add_argument("--k", type=positive_int, default=4, help="fragments per query (default: 4)")
    parser.add_argument("--frag-tokens", type=positive_int, default=100, help="tokens per fragment (default: 100)")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of fragment popularity (default: 1.1)")
    parser.add_argument("--bulk", type=int_list, default=[1, 64, 0],
                        help="bulk sizes; 0 = the whole workload (default: 1,64,0)")
    parser.add_argument("--kv-blocks", type=positive_int, default=1024,
                        help="KV cache size of each engine, in 32-token blocks (default: 1024)")
    parser.add_argument("--concurrency", type=positive_int, default=16, help="engine max_num_seqs (default: 16)")
    add_recompute_flag(parser)
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] = (), *, backends: tuple[Any, Any] | None = None) -> int:
    """Run the benchmark; `backends` = (stock, spans) to reuse engines instead of starting two."""
    from spanq_integrations import Plus, execute

    args = parse_args(argv)
    report = BenchReport("bulk", args)
    settings = [(b, o) for b in args.bulk for o in (("arrival",) if b == 1 else ("arrival", "locality"))]
    options = engine_options_of(args, kv_blocks=args.kv_blocks, max_model_len=4096, max_num_seqs=args.concurrency)
    with engine_pair(args.model, backends=backends, **options) as (stock, spans):
        w = make_workload(spans.engine.tokenizer, pool=args.pool, queries=args.queries, k=args.k,
                          frag_tokens=args.frag_tokens, zipf=args.zipf, seed=args.seed)
        report.config.update({"unique_fragments": w.unique_fragments(), "fragment_reads": args.queries * args.k})
        bar = progress(len(settings) * 3 * args.reps * len(w.queries), "bulk", disable=args.no_progress)
        session = 0
        for rep in range(args.reps):
            for size, order in settings:
                for mode, backend in (("stock", stock), ("stock_canonical", stock), ("spans", spans)):
                    session += 1
                    # the span engine's background work (deferred prepares) done first: run beside the next
                    # measurement it would slow it, and queued past the reset it would warm the next spans run
                    settle(spans)
                    reset_cache(backend)  # cold: a span read in an earlier setting would hit under any prefix
                    calls: list[Any] = []
                    t0 = time.perf_counter()
                    for batch in bulks(w, size, order, session, canonical=mode == "stock_canonical"):
                        result = execute(Plus(children=tuple(batch)) if len(batch) > 1 else batch[0], backend)
                        calls += result.calls
                        bar.update(len(batch))
                    wall = time.perf_counter() - t0
                    report.rows.append(setting_row(calls, size or len(w.queries), order, mode, rep, wall))
        bar.close()

    report.summary = summarize_rows(report.rows)
    print(render_table(report.summary, args, w))
    report.write(plot(report.summary, args))
    report.print_files()
    return 0


def setting_row(calls: list[Any], size: int, order: str, mode: str, rep: int, wall: float) -> dict[str, Any]:
    ttfts = [ttft_of(c) for c in calls]
    # spans a call read: those in its table, and the cold ones it read in context (deferred); a miss is a span it
    # prepared itself or read in context
    spans = sum(c.extra.get("spans", 0) + c.deferred_spans for c in calls)
    prepared = sum(c.prepared_spans + c.deferred_spans for c in calls)
    prompt = sum(c.prompt_tokens for c in calls)
    return {
        "bulk": size, "order": order, "mode": mode, "rep": rep, "calls": len(calls), "wall_s": wall,
        "ttft": summarize(ttfts), "prompt_tokens": prompt, "cached_tokens": sum(c.cached_tokens for c in calls),
        "token_hit_rate": sum(c.cached_tokens for c in calls) / max(1, prompt),
        "spans": spans, "prepared_spans": prepared,
        "span_hit_rate": (1 - prepared / spans) if spans else None,
        "padded_tokens": sum(c.padded_tokens for c in calls),
    }


def summarize_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (bulk, order): both engines' mean TTFT and hit rates, and the mean-TTFT speedup of spans over stock."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys((r["bulk"], r["order"]) for r in rows):
        at = [r for r in rows if (r["bulk"], r["order"]) == key]
        by = {m: [r for r in at if r["mode"] == m] for m in ("stock", "stock_canonical", "spans")}

        def mean(mode: str, field: str, by: dict[str, list[dict[str, Any]]] = by) -> float:
            vals = [r[field]["mean"] if field == "ttft" else r[field] for r in by[mode]]
            vals = [v for v in vals if v is not None]
            return sum(vals) / len(vals) if vals else float("nan")

        out[f"{key[0]}/{key[1]}"] = {
            "bulk": key[0], "order": key[1],
            "stock_mean_ttft_s": mean("stock", "ttft"), "spans_mean_ttft_s": mean("spans", "ttft"),
            "stock_p90_ttft_s": sum(r["ttft"]["p90"] for r in by["stock"]) / max(1, len(by["stock"])),
            "spans_p90_ttft_s": sum(r["ttft"]["p90"] for r in by["spans"]) / max(1, len(by["spans"])),
            "speedup_mean_ttft": mean("stock", "ttft") / mean("spans", "ttft"),
            "canonical_mean_ttft_s": mean("stock_canonical", "ttft"),
            "speedup_vs_canonical": mean("stock_canonical", "ttft") / mean("spans", "ttft"),
            "canonical_token_hit_rate": mean("stock_canonical", "token_hit_rate"),
            "stock_token_hit_rate": mean("stock", "token_hit_rate"),
            "spans_token_hit_rate": mean("spans", "token_hit_rate"),
            "span_hit_rate": mean("spans", "span_hit_rate"),
            "stock_wall_s": mean("stock", "wall_s"), "spans_wall_s": mean("spans", "wall_s"),
        }
    return out


def render_table(summary: dict[str, Any], args: argparse.Namespace, w: Workload) -> str:
    ms = 1000.0
    rows = [
        [e["bulk"], e["order"], e["stock_token_hit_rate"], e["canonical_token_hit_rate"], e["spans_token_hit_rate"],
         e["span_hit_rate"], e["stock_mean_ttft_s"] * ms, e["canonical_mean_ttft_s"] * ms, e["spans_mean_ttft_s"] * ms,
         e["speedup_mean_ttft"], e["speedup_vs_canonical"], e["stock_wall_s"], e["spans_wall_s"]]
        for e in summary.values()
    ]
    headers = ["bulk", "order", "stock tok hit", "canon tok hit", "spans tok hit", "span hit", "stock TTFT",
               "canon TTFT", "spans TTFT", "x stock", "x canon", "stock wall s", "spans wall s"]
    title = (f"bulk on {model_label(args.model)}: {args.queries} queries x {args.k} of {args.pool} fragments "
             f"(~{args.frag_tokens} tokens, Zipf {args.zipf:g}; {w.unique_fragments()} distinct read), KV cache "
             f"{args.kv_blocks} blocks; tok hit = cached / prompt tokens, span hit = spans found cached; canon = "
             "stock with each query's fragments in canonical order; TTFT = mean ms")
    return title + "\n" + format_table(headers, rows)


def plot(summary: dict[str, Any], args: argparse.Namespace) -> Any:
    fig, (ax, ax2) = new_figure(2, width=5.5)
    entries = list(summary.values())
    labels = [f"{'all' if e['bulk'] == args.queries else e['bulk']}\n{e['order']}" for e in entries]
    xs = range(len(entries))
    ax.bar([x - 0.3 for x in xs], [e["stock_token_hit_rate"] for e in entries], 0.2, label="stock (tokens)",
           color="k")
    ax.bar([x - 0.1 for x in xs], [e["canonical_token_hit_rate"] for e in entries], 0.2,
           label="stock, canonical order (tokens)", color="tab:green")
    ax.bar([x + 0.1 for x in xs], [e["spans_token_hit_rate"] for e in entries], 0.2, label="spans (tokens)",
           color="tab:blue")
    ax.bar([x + 0.3 for x in xs], [e["span_hit_rate"] for e in entries], 0.2, label="spans (spans found cached)",
           color="tab:cyan")
    ax.set_xticks(list(xs), labels)
    ax.set_ylim(0, 1)
    ax.set_ylabel("hit rate")
    ax.set_title(f"bulk, {model_label(args.model)}: cache hit rate")
    ax.legend(fontsize=8)
    ax2.bar(list(xs), [e["speedup_mean_ttft"] for e in entries], 0.5, color="tab:blue")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xticks(list(xs), labels)
    ax2.set_ylabel("mean TTFT speedup over stock")
    ax2.set_title("spans vs stock, same bulk and order")
    fig.tight_layout()
    return fig
