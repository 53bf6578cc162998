"""`spanq bench quality`: what span attention costs in answer quality, against full attention on the same model.

Each item is a small QA task built here (deterministic for a seed): `--docs` one-paragraph documents, each about
a different invented town and the colour its town hall is painted; the question asks for one town's colour, so
the answer sits in exactly one document and the others are distractors. Measured per item:

- exact match: greedy answers of the stock engine (full attention, the plain prompt) and of the span-aware
  engine (span attention, the span layout), scored by whether they name the right colour, and whether the two
  answers are identical;
- KL divergence: with HF transformers on the span layout's tokens (padding included, so only attention
  differs), the next-token distributions along a gold answer ("The town hall of X is painted C."), span
  attention against full attention: mean per-token KL(full || span) in nats, and the log-probability of
  the gold colour under each;
- padding: the tokens the span layout adds to align spans to KV blocks.
"""

from __future__ import annotations

import argparse
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.common import (
    BenchReport,
    base_parser,
    engine_pair,
    format_table,
    model_label,
    new_figure,
    progress,
    summarize,
)

__all__ = ["QAItem", "main", "make_items"]

TOWNS = (
    "Alderbrook", "Bramblewick", "Caldermoor", "Dunhollow", "Elmstead", "Fernwick", "Galeford", "Harrowgate",
    "Ivyholm", "Juniper Falls", "Kestrelby", "Larchmere", "Marrowdale", "Nettlecombe", "Oakhurst", "Pebbleton",
    "Quillsby", "Rookhaven", "Saltmarsh", "Thistledown", "Umberlea", "Valewood", "Wrenfield", "Yarrowby",
    "Zephyr Cove", "Ashcombe", "Birchley", "Coldwater", "Drakemoor", "Eastwick",
)
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black", "pink", "brown", "grey", "gold")
FEATURES = ("river", "lake", "forest", "hill", "coast", "valley", "marsh", "canal")
GOODS = ("cheese", "apples", "wool", "pottery", "bread", "honey", "fish", "candles")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
SYSTEM = "You answer questions about towns using only the documents. Answer in one short sentence."


@dataclass(frozen=True)
class QAItem:
    docs: list[str]
    target: int  # the document that holds the answer
    town: str
    color: str
    question: str

    @property
    def gold(self) -> str:
        return f"The town hall of {self.town} is painted {self.color}."


def make_items(count: int, docs: int, *, seed: int) -> list[QAItem]:
    """`count` QA items of `docs` documents each (different towns, different colours); see the module docstring."""
    rng = random.Random(f"spanq-quality:{seed}")
    towns = list(TOWNS)
    items = []
    for _ in range(count):
        names = rng.sample(towns, docs)
        colors = rng.sample(COLORS, docs)
        texts = []
        for name, color in zip(names, colors):
            texts.append(
                f"{name} is a small town by the {rng.choice(FEATURES)}. Its town hall is painted {color}. "
                f"The market of {name} sells {rng.choice(GOODS)} every {rng.choice(DAYS)}, and visitors come "
                f"in summer to walk along the {rng.choice(FEATURES)}."
            )
        target = rng.randrange(docs)
        question = f"What colour is the town hall of {names[target]} painted?"
        items.append(QAItem(texts, target, names[target], colors[target], question))
    return items


def qa_query(item: QAItem, max_tokens: int) -> Any:
    from spanq_integrations import cross, fragment, generate, plus, system, user

    return generate(
        cross(system(SYSTEM), plus(*[fragment(d, id=f"doc{i}") for i, d in enumerate(item.docs)]), user(item.question)),
        max_tokens=max_tokens,
        temperature=0.0,
    )


def names_color(answer: str, color: str) -> bool:
    return re.search(rf"\b{re.escape(color)}\b", answer.lower()) is not None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = base_parser("quality", __doc__.splitlines()[0], model="default", reps=1)
    parser.add_argument("--items", type=int, default=20, help="QA items (default: 20)")
    parser.add_argument("--docs", type=int, default=5, help="documents per item (default: 5)")
    parser.add_argument("--max-tokens", type=int, default=16, help="answer length for exact match (default: 16)")
    parser.add_argument("--no-kl", action="store_true", help="skip the HF transformers KL measurement")
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] = (), *, backends: tuple[Any, Any] | None = None) -> int:
    """Run the benchmark; `backends` = (stock, spans) to reuse engines instead of starting two."""
    import torch

    from benchmarks import hf_span
    from spanq_backend.serving.models import resolve_model
    from spanq_integrations import execute

    args = parse_args(argv)
    report = BenchReport("quality", args)
    items = make_items(args.items, args.docs, seed=args.seed)
    hf_model = None if args.no_kl else hf_span.load_hf_model(resolve_model(args.model))
    with engine_pair(args.model, backends=backends, max_model_len=4096, max_num_seqs=4) as (stock, spans):
        tokenizer = spans.engine.tokenizer
        bar = progress(len(items), "quality", disable=args.no_progress)
        for k, item in enumerate(items):
            query = qa_query(item, args.max_tokens)
            answers, calls = {}, {}
            for mode, backend in (("stock", stock), ("spans", spans)):
                result = execute(query, backend)
                answers[mode], (calls[mode],) = result.answer, result.calls
            row: dict[str, Any] = {
                "item": k, "town": item.town, "color": item.color, "target_doc": item.target,
                "stock_answer": answers["stock"], "spans_answer": answers["spans"],
                "stock_correct": names_color(answers["stock"], item.color),
                "spans_correct": names_color(answers["spans"], item.color),
                "answers_identical": answers["stock"].strip() == answers["spans"].strip(),
                "prompt_tokens_stock": calls["stock"].prompt_tokens,
                "prompt_tokens_spans": calls["spans"].prompt_tokens,
                "padded_tokens": calls["spans"].padded_tokens,
            }
            if hf_model is not None:
                lowered = spans.engine.generator.lower(query)
                gold = tokenizer.encode(item.gold, add_special_tokens=False)
                full = hf_span.full_attention_next_token_logprobs(hf_model, lowered.token_ids, gold)
                span = hf_span.span_attention_next_token_logprobs(
                    hf_model, lowered.token_ids, lowered.table.spans, gold
                )
                kl = hf_span.kl_divergence(full, span)
                color_at = _color_positions(tokenizer, item)
                idx = torch.tensor(gold)
                rows_full = full[torch.arange(len(gold)), idx]
                rows_span = span[torch.arange(len(gold)), idx]
                row.update({
                    "kl_mean": float(kl.mean()), "kl_first_token": float(kl[0]), "kl_max": float(kl.max()),
                    "gold_logprob_full": float(rows_full.sum()), "gold_logprob_span": float(rows_span.sum()),
                    "color_logprob_full": float(rows_full[color_at].sum()),
                    "color_logprob_span": float(rows_span[color_at].sum()),
                    "argmax_agreement": float((full.argmax(-1) == span.argmax(-1)).double().mean()),
                })
            report.rows.append(row)
            bar.update(1)
        bar.close()

    report.summary = summarize_rows(report.rows, args.docs)
    print(render_table(report.summary, report.rows, args))
    report.write(plot(report.rows, args))
    report.print_files()
    return 0


def _color_positions(tokenizer: Any, item: QAItem) -> list[int]:
    """Positions of the colour's tokens inside the gold answer's tokens."""
    prefix = tokenizer.encode(f"The town hall of {item.town} is painted", add_special_tokens=False)
    gold = tokenizer.encode(item.gold, add_special_tokens=False)
    end = len(tokenizer.encode(f"The town hall of {item.town} is painted {item.color}", add_special_tokens=False))
    return list(range(len(prefix), min(end, len(gold))))


def summarize_rows(rows: list[dict[str, Any]], docs: int) -> dict[str, Any]:
    n = max(1, len(rows))
    out: dict[str, Any] = {
        "items": len(rows),
        "chance": 1.0 / docs,
        "stock_exact_match": sum(r["stock_correct"] for r in rows) / n,
        "spans_exact_match": sum(r["spans_correct"] for r in rows) / n,
        "answers_identical": sum(r["answers_identical"] for r in rows) / n,
        "padding_overhead": sum(r["padded_tokens"] for r in rows) / max(1, sum(r["prompt_tokens_spans"] for r in rows)),
        "prompt_tokens_stock": summarize([r["prompt_tokens_stock"] for r in rows])["mean"],
        "prompt_tokens_spans": summarize([r["prompt_tokens_spans"] for r in rows])["mean"],
    }
    if rows and "kl_mean" in rows[0]:
        for key in ("kl_mean", "kl_first_token", "kl_max", "gold_logprob_full", "gold_logprob_span",
                    "color_logprob_full", "color_logprob_span", "argmax_agreement"):
            out[key] = summarize([r[key] for r in rows])
    return out


def render_table(summary: dict[str, Any], rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        ["items", summary["items"]],
        ["exact match, stock (full attention)", summary["stock_exact_match"]],
        ["exact match, spans", summary["spans_exact_match"]],
        ["chance (one of the documents' colours)", summary["chance"]],
        ["answers identical (stock vs spans)", summary["answers_identical"]],
        ["prompt tokens, stock / spans", f"{summary['prompt_tokens_stock']:.0f} / {summary['prompt_tokens_spans']:.0f}"],
        ["padding overhead (padded / span-layout tokens)", summary["padding_overhead"]],
    ]
    if "kl_mean" in summary:
        lines += [
            ["KL(full || span) per token, mean (nats)", summary["kl_mean"]["mean"]],
            ["KL at the answer's first token, mean", summary["kl_first_token"]["mean"]],
            ["KL per token, worst item mean", summary["kl_mean"]["max"]],
            ["gold colour logprob, full attention", summary["color_logprob_full"]["mean"]],
            ["gold colour logprob, span attention", summary["color_logprob_span"]["mean"]],
            ["gold answer logprob, full / span",
             f"{summary['gold_logprob_full']['mean']:.2f} / {summary['gold_logprob_span']['mean']:.2f}"],
            ["argmax agreement along the gold answer", summary["argmax_agreement"]["mean"]],
        ]
    title = (f"quality on {model_label(args.model)}: {summary['items']} items x {args.docs} documents, "
             "greedy answers; KL from HF transformers on the span layout")
    return title + "\n" + format_table(["measure", "value"], lines)


def plot(rows: list[dict[str, Any]], args: argparse.Namespace) -> Any:
    fig, (ax, ax2) = new_figure(2, width=5.0)
    n = max(1, len(rows))
    ax.bar(["stock\n(full attention)", "spans"],
           [sum(r["stock_correct"] for r in rows) / n, sum(r["spans_correct"] for r in rows) / n],
           color=["k", "tab:blue"])
    ax.axhline(1.0 / args.docs, color="tab:red", ls="--", label="chance")
    ax.set_ylim(0, 1)
    ax.set_ylabel("exact match (names the right colour)")
    ax.set_title(f"QA over {args.docs} documents, {model_label(args.model)}")
    ax.legend()
    if rows and "kl_mean" in rows[0]:
        ax2.scatter([r["color_logprob_full"] for r in rows], [r["color_logprob_span"] for r in rows], color="tab:blue")
        lo = min(min(r["color_logprob_full"], r["color_logprob_span"]) for r in rows)
        ax2.plot([lo, 0], [lo, 0], color="k", lw=0.8)
        ax2.set_xlabel("gold colour log-prob, full attention")
        ax2.set_ylabel("gold colour log-prob, span attention")
        kl = summarize([r["kl_mean"] for r in rows])["mean"]
        ax2.set_title(f"per item; mean per-token KL = {kl:.3g} nats")
    else:
        ax2.set_axis_off()
    fig.tight_layout()
    return fig
