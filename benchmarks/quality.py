"""`spanq bench quality`: what span attention costs in answer quality, against full attention on the same model.

Each item is a small QA task built here (deterministic for a seed): `--docs` one-paragraph documents, each about
a different invented town and the colour its town hall is painted; the question asks for one town's colour, so
the answer sits in exactly one document and the others are distractors. Measured per item:

- exact match: greedy answers of the stock engine (full attention, the plain prompt) and of the span-aware
  engine (span attention, the span layout) under each anchor policy (`--anchors`), scored by whether they name
  the right colour, and whether the answer is identical to stock's;
- KL divergence: with HF transformers on the span layout's tokens (padding included, so only attention
  differs), the next-token distributions along a gold answer ("The town hall of X is painted C."), span
  attention under each policy's anchors against full attention: mean per-token KL(full || span) in nats,
  argmax agreement, and the log-probability of the gold colour under each;
- padding: the tokens the span layout adds to align spans to KV blocks.

The anchor policies differ in what a document's KV attended to: "prefix" the system prompt (the whole prompt
before the documents), "system" the system prompt in a bare chat opening, "template" the chat template's
opening alone. What they buy is reuse (docs/design.md, "Anchors"); this is what they cost.
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


ANCHORS = ("template", "system", "prefix")


def qa_query(item: QAItem, max_tokens: int, anchor: str | None = None) -> Any:
    from spanq_integrations import cross, fragment, generate, plus, system, user

    docs = plus(*[fragment(d, id=f"doc{i}") for i, d in enumerate(item.docs)], anchor=anchor)
    return generate(
        cross(system(SYSTEM), docs, user(item.question)),
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
    parser.add_argument("--anchors", type=_anchor_list, default=list(ANCHORS),
                        help="anchor policies to measure (default: template,system,prefix)")
    return parser.parse_args(list(argv))


def _anchor_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in ANCHORS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown anchor policies {unknown}; choose from {', '.join(ANCHORS)}")
    return names


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
        bar = progress(len(items) * len(args.anchors), "quality", disable=args.no_progress)
        for k, item in enumerate(items):
            stock_call = qa_query(item, args.max_tokens)
            stock_result = execute(stock_call, stock)
            stock_answer, (stock_metrics,) = stock_result.answer, stock_result.calls
            gold = tokenizer.encode(item.gold, add_special_tokens=False)
            color_at = _color_positions(tokenizer, item)
            for anchor in args.anchors:
                query = qa_query(item, args.max_tokens, anchor)
                result = execute(query, spans)
                (call,) = result.calls
                row: dict[str, Any] = {
                    "item": k, "anchor": anchor, "town": item.town, "color": item.color, "target_doc": item.target,
                    "stock_answer": stock_answer, "spans_answer": result.answer,
                    "stock_correct": names_color(stock_answer, item.color),
                    "spans_correct": names_color(result.answer, item.color),
                    "answers_identical": stock_answer.strip() == result.answer.strip(),
                    "prompt_tokens_stock": stock_metrics.prompt_tokens,
                    "prompt_tokens_spans": call.prompt_tokens,
                    "padded_tokens": call.padded_tokens,
                }
                if hf_model is not None:
                    lowered = spans.engine.generator.lower(query)
                    full = hf_span.full_attention_next_token_logprobs(hf_model, lowered.token_ids, gold)
                    span = hf_span.span_attention_next_token_logprobs(hf_model, lowered.token_ids, lowered.table, gold)
                    kl = hf_span.kl_divergence(full, span)
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
    """Per anchor policy: exact match of stock and spans, agreement, padding, and (with HF) KL and logprobs."""
    out: dict[str, Any] = {"items": len({r["item"] for r in rows}), "chance": 1.0 / docs, "anchors": {}}
    for anchor in dict.fromkeys(r["anchor"] for r in rows):
        at = [r for r in rows if r["anchor"] == anchor]
        n = max(1, len(at))
        entry: dict[str, Any] = {
            "stock_exact_match": sum(r["stock_correct"] for r in at) / n,
            "spans_exact_match": sum(r["spans_correct"] for r in at) / n,
            "answers_identical": sum(r["answers_identical"] for r in at) / n,
            "padding_overhead": sum(r["padded_tokens"] for r in at) / max(1, sum(r["prompt_tokens_spans"] for r in at)),
            "prompt_tokens_stock": summarize([r["prompt_tokens_stock"] for r in at])["mean"],
            "prompt_tokens_spans": summarize([r["prompt_tokens_spans"] for r in at])["mean"],
        }
        if "kl_mean" in at[0]:
            for key in ("kl_mean", "kl_first_token", "kl_max", "gold_logprob_full", "gold_logprob_span",
                        "color_logprob_full", "color_logprob_span", "argmax_agreement"):
                entry[key] = summarize([r[key] for r in at])
        out["anchors"][anchor] = entry
    return out


def render_table(summary: dict[str, Any], rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    anchors = summary["anchors"]
    kl = any("kl_mean" in e for e in anchors.values())
    headers = ["anchor", "exact stock", "exact spans", "same answer", "padding"]
    if kl:
        headers += ["KL/token", "KL 1st token", "argmax agree", "colour lp full", "colour lp span"]
    lines = []
    for name, e in anchors.items():
        line = [name, e["stock_exact_match"], e["spans_exact_match"], e["answers_identical"], e["padding_overhead"]]
        if kl:
            line += [e["kl_mean"]["mean"], e["kl_first_token"]["mean"], e["argmax_agreement"]["mean"],
                     e["color_logprob_full"]["mean"], e["color_logprob_span"]["mean"]]
        lines.append(line)
    title = (f"quality on {model_label(args.model)}: {summary['items']} items x {args.docs} documents, greedy "
             f"answers (chance {summary['chance']:.2f}); KL(full || span) from HF transformers on the span layout, "
             "per anchor policy")
    return title + "\n" + format_table(headers, lines)


def plot(rows: list[dict[str, Any]], args: argparse.Namespace) -> Any:
    fig, (ax, ax2) = new_figure(2, width=5.0)
    anchors = list(dict.fromkeys(r["anchor"] for r in rows))
    colors = dict(zip(ANCHORS, ("tab:blue", "tab:orange", "tab:green")))
    first = [r for r in rows if r["anchor"] == anchors[0]] if anchors else []
    bars = [sum(r["stock_correct"] for r in first) / max(1, len(first))]
    for a in anchors:
        at = [r for r in rows if r["anchor"] == a]
        bars.append(sum(r["spans_correct"] for r in at) / max(1, len(at)))
    ax.bar(["stock\n(full)", *anchors], bars, color=["k", *(colors[a] for a in anchors)])
    ax.axhline(1.0 / args.docs, color="tab:red", ls="--", label="chance")
    ax.set_ylim(0, 1)
    ax.set_ylabel("exact match (names the right colour)")
    ax.set_title(f"QA over {args.docs} documents, {model_label(args.model)}")
    ax.legend()
    if rows and "kl_mean" in rows[0]:
        lo = min(min(r["color_logprob_full"], r["color_logprob_span"]) for r in rows)
        for a in anchors:
            at = [r for r in rows if r["anchor"] == a]
            kl = summarize([r["kl_mean"] for r in at])["mean"]
            ax2.scatter([r["color_logprob_full"] for r in at], [r["color_logprob_span"] for r in at],
                        color=colors[a], label=f"{a} (KL {kl:.3g})", s=14)
        ax2.plot([lo, 0], [lo, 0], color="k", lw=0.8)
        ax2.set_xlabel("gold colour log-prob, full attention")
        ax2.set_ylabel("gold colour log-prob, span attention")
        ax2.set_title("per item and anchor policy; KL per token in nats")
        ax2.legend(fontsize=8)
    else:
        ax2.set_axis_off()
    fig.tight_layout()
    return fig
