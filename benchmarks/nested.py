"""`spanq bench nested`: a judge over N inner generations — the outer call's time to first token, spans vs stock.

Each query asks N inner generations for a short poem on a topic (fresh per repetition, so nothing carries over
between repetitions), then one outer judge reads the N poems as a `plus` and names the best. At temperature 0
the N poems are identical (one span, read N times), at temperature > 0 they differ (N spans). On the span-aware
engine each inner prompt is padded so its poem starts on a KV block, and each poem's last block is computed
as soon as the poem is done (sealed): the judge reads the poems alone, as spans anchored on their own prompts,
reusing the KV their generation left. The inner calls are seeded, but the padding changes what a sampled
inner call writes, so the two engines judge different poems of the same kind.

Compared: the outer judge's TTFT (on the span-aware engine it includes any span it still had to prepare), the
whole query's wall time (inner calls, sealing and judge), and the judge's prompt (tokens besides padding).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from typing import Any

from benchmarks.common import (
    WORDS,
    BenchReport,
    add_recompute_flag,
    base_parser,
    engine_options_of,
    engine_pair,
    format_table,
    model_label,
    new_figure,
    percentile,
    positive_int,
    positive_int_list,
    progress,
    settle,
    summarize,
    temperature_list,
    ttft_of,
)

__all__ = ["main"]

PERCENTILES = (50, 90, 99)
JUDGE_SYSTEM = "You are a strict judge of poetry. Read the candidate poems and pick the best one."
JUDGE_QUESTION = "Which poem is best? Answer with its number only."


def nested_query(fan_out: int, temperature: float, topic: str, seed: int, inner_tokens: int) -> Any:
    from spanq_integrations import cross, generate, plus, system, user

    inner = [
        generate(
            cross(system("You are a poet. Write four short lines."), user(f"Write a short poem about {topic}.")),
            max_tokens=inner_tokens,
            temperature=temperature,
            seed=seed + i if temperature > 0 else None,
        )
        for i in range(fan_out)
    ]
    return generate(
        cross(system(JUDGE_SYSTEM), plus(*inner), user(JUDGE_QUESTION)), max_tokens=1, temperature=0.0
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = base_parser("nested", __doc__, model="tiny", reps=5)
    parser.add_argument("--fan-out", type=positive_int_list, default=[1, 2, 4, 8, 16, 24],
                        help="inner generations per judge (default: 1,2,4,8,16,24)")
    parser.add_argument("--temperatures", type=temperature_list, default=[0.0, 0.5],
                        help="inner sampling temperatures (default: 0,0.5)")
    parser.add_argument("--inner-tokens", type=positive_int, default=128, help="tokens per inner generation (default: 128)")
    parser.add_argument("--max-model-len", type=positive_int, default=8192, help="engine context length (default: 8192)")
    add_recompute_flag(parser)
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] = (), *, backends: tuple[Any, Any] | None = None) -> int:
    """Run the benchmark; `backends` = (stock, spans) to reuse engines instead of starting two."""
    from spanq_integrations import execute

    args = parse_args(argv)
    report = BenchReport("nested", args)
    settings = [(t, n) for t in args.temperatures for n in args.fan_out]
    options = engine_options_of(args, max_model_len=args.max_model_len, max_num_seqs=max(16, *args.fan_out))
    with engine_pair(args.model, backends=backends, **options) as (stock, spans):
        bar = progress(len(settings) * args.reps * 2, "nested", disable=args.no_progress)
        rng = random.Random(f"spanq-nested:{args.seed}")
        for t, n in settings:
            for rep in range(args.reps):
                topic = f"the {rng.choice(WORDS)} {rng.choice(WORDS)} and the {rng.choice(WORDS)}"
                seed = rng.randrange(1 << 30)
                query = nested_query(n, t, topic, seed, args.inner_tokens)
                for mode, backend in (("stock", stock), ("spans", spans)):
                    settle(spans)  # background work of the span engine's last query: not beside this measurement
                    result = execute(query, backend)
                    outer = next(c for c in result.calls if c.path == "$")
                    inner = [c for c in result.calls if c.path != "$"]
                    source = result.tree.source.input
                    texts = [c.text for c in _candidates(source)]
                    report.rows.append({
                        "temperature": t, "fan_out": n, "rep": rep, "mode": mode, "topic": topic,
                        "outer_ttft_s": ttft_of(outer), "outer_prompt_tokens": outer.prompt_tokens,
                        "outer_cached_tokens": outer.cached_tokens, "outer_padded_tokens": outer.padded_tokens,
                        "outer_prepared_spans": outer.prepared_spans, "outer_prepared_tokens": outer.prepared_tokens,
                        "outer_spans": outer.extra.get("spans", 0),
                        "outer_generated_spans": outer.extra.get("generated_spans", 0),
                        "inner_wall_s": max((c.wall_s for c in inner), default=0.0),
                        "sealed_tokens": sum(c.prepared_tokens for c in inner),
                        "distinct_candidates": len(set(texts)), "wall_s": result.wall_s,
                    })
                    bar.update(1)
        bar.close()

    report.summary = summarize_rows(report.rows, settings)
    print(render_table(report.summary, args))
    report.write(plot(report.summary, args))
    report.print_files()
    return 0


def _candidates(judge_input: Any) -> list[Any]:
    from spanq_integrations import Assistant, Cross, Plus

    if isinstance(judge_input, Cross):
        for child in judge_input.children:
            if isinstance(child, Plus):
                return [c for c in child.children if isinstance(c, Assistant)]
            if isinstance(child, Assistant):
                return [child]
    return []


def summarize_rows(rows: list[dict[str, Any]], settings: Sequence[tuple[float, int]]) -> dict[str, Any]:
    """Per (temperature, fan-out): outer TTFT percentiles of each engine and the speedup at each percentile."""
    out: dict[str, Any] = {}
    for t, n in settings:
        at = [r for r in rows if r["temperature"] == t and r["fan_out"] == n]
        ttft = {m: [r["outer_ttft_s"] for r in at if r["mode"] == m] for m in ("stock", "spans")}
        entry: dict[str, Any] = {m: summarize(v) for m, v in ttft.items()}
        for q in PERCENTILES:
            entry[f"speedup_p{q}"] = percentile(ttft["stock"], q) / percentile(ttft["spans"], q)
        spans_rows = [r for r in at if r["mode"] == "spans"]
        stock_rows = [r for r in at if r["mode"] == "stock"]
        entry["outer_prompt_tokens_stock"] = summarize([r["outer_prompt_tokens"] for r in stock_rows])["mean"]
        entry["outer_prompt_tokens_spans"] = summarize([r["outer_prompt_tokens"] for r in spans_rows])["mean"]
        entry["outer_unpadded_tokens_spans"] = summarize(
            [r["outer_prompt_tokens"] - r["outer_padded_tokens"] for r in spans_rows])["mean"]
        entry["distinct_candidates"] = summarize([r["distinct_candidates"] for r in spans_rows])["mean"]
        entry["spans_in_outer"] = summarize([r["outer_spans"] for r in spans_rows])["mean"]
        entry["generated_spans"] = summarize([r["outer_generated_spans"] for r in spans_rows])["mean"]
        wall = {m: [r["wall_s"] for r in at if r["mode"] == m] for m in ("stock", "spans")}
        entry["wall_stock"], entry["wall_spans"] = summarize(wall["stock"]), summarize(wall["spans"])
        entry["speedup_wall_p50"] = percentile(wall["stock"], 50) / percentile(wall["spans"], 50)
        out[f"t={t:g},n={n}"] = {"temperature": t, "fan_out": n, **entry}
    return out


def render_table(summary: dict[str, Any], args: argparse.Namespace) -> str:
    ms = 1000.0
    rows = [
        [f"{e['temperature']:g}", e["fan_out"], e["outer_prompt_tokens_stock"], e["outer_unpadded_tokens_spans"],
         e["distinct_candidates"], e["stock"]["median"] * ms, e["spans"]["median"] * ms, e["stock"]["p99"] * ms,
         e["spans"]["p99"] * ms, e["speedup_p50"], e["speedup_p90"], e["speedup_p99"], e["speedup_wall_p50"]]
        for e in summary.values()
    ]
    headers = ["temp", "fan-out", "judge tok", "spans tok", "distinct", "stock p50", "spans p50", "stock p99",
               "spans p99", "x p50", "x p90", "x p99", "wall x p50"]
    title = (f"nested on {model_label(args.model)}: outer judge TTFT in ms over {args.reps} reps, "
             f"{args.inner_tokens}-token inner generations; x pN = stock pN / spans pN; judge tok: the stock "
             "judge's prompt, spans tok: the span judge's without padding; wall: the whole query")
    return title + "\n" + format_table(headers, rows)


def plot(summary: dict[str, Any], args: argparse.Namespace) -> Any:
    fig, (ax, ax2) = new_figure(2, width=5.5)
    temps = sorted({e["temperature"] for e in summary.values()})
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for i, t in enumerate(temps):
        es = sorted((e for e in summary.values() if e["temperature"] == t), key=lambda e: e["fan_out"])
        xs = [e["fan_out"] for e in es]
        c = colors[i % len(colors)]
        ax.plot(xs, [e["stock"]["median"] * 1000 for e in es], ls="--", marker="o", color=c, label=f"stock, T={t:g}")
        ax.plot(xs, [e["spans"]["median"] * 1000 for e in es], ls="-", marker="o", color=c, label=f"spans, T={t:g}")
        for q, ls in zip(PERCENTILES, ("-", "--", ":")):
            ax2.plot(xs, [e[f"speedup_p{q}"] for e in es], ls=ls, marker="o", color=c, label=f"p{q}, T={t:g}")
    ax.set_xlabel("inner generations (fan-out)")
    ax.set_ylabel("outer TTFT, ms (median)")
    ax.set_yscale("log")
    ax.set_title(f"nested judge, {model_label(args.model)}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xlabel("inner generations (fan-out)")
    ax2.set_ylabel("speedup of outer TTFT (stock / spans)")
    ax2.set_title("speedup at p50 / p90 / p99")
    ax2.legend(fontsize=8)
    ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig
