"""How often the order-free span judge agrees with LlamaIndex's two-call swapped consensus, and what it saves.

`PairwiseComparisonEvaluator` (enforce_consensus=True) asks the judge twice, the answers swapped, each time for
an explanation and a verdict ([[A]], [[B]] or [[C]]); `SpanQueryPairwiseEvaluator` asks once, the answers an
order-free `plus` of spans, and matches the judge's copy of the best answer back to it. Both run on the same
`SpanQueryLLM` (the embedded default, SmolLM2-135M-Instruct, greedy) over the same pairs, built here: for each
of eight towns, a question, a one-line reference, the right answer, a wrong one (another town's colour) and an
off-topic one; each right answer meets both others, once first and once second. Prints a table per pair, the
agreement, each judge's accuracy against the known better answer, and the calls, tokens and time each spent.

A model as small as SmolLM2-135M seldom writes the verdict exactly as `[[A]]`, so the consensus is computed
twice from the same calls: with LlamaIndex's default parser ("strict") and with a parser that also reads
`[A]`, `Assistant A` or `Answer A` ("lenient": the last such mention is the verdict). The evaluator runs with
the lenient one, so the swapped call is made whenever either parser could read the first verdict.

    .venv/bin/python examples/judge/llamaindex_judge_agreement.py [--model default|tiny|PATH] [--pairs 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.evaluation import PairwiseComparisonEvaluator
from llama_index.core.evaluation.pairwise import _default_parser_function as strict_parser  # LlamaIndex's own
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent

from spanq_integrations.llamaindex import SpanQueryLLM, SpanQueryPairwiseEvaluator

# town, the colour of its town hall, one more fact (the off-topic answer)
TOWNS = [
    ("Lindale Harbor", "sea green", "Lindale Harbor holds a herring festival every spring."),
    ("Brackwell", "bright yellow", "Brackwell grows more than forty kinds of apples."),
    ("Corrow Ridge", "dark red", "The last mine in Corrow Ridge closed in 1974."),
    ("Pell Crossing", "pale blue", "Pell Crossing has a weekly boat market."),
    ("Ashford Hill", "white", "Ashford Hill's university library holds two million books."),
    ("Sarn Well", "sand orange", "Sarn Well gets its water from a deep well."),
    ("Hollin Isle", "lavender", "There are no cars on Hollin Isle."),
    ("Deepmoor", "moss green", "Woodcarvers in Deepmoor sell bowls made of oak."),
]


@dataclass(frozen=True)
class Pair:
    question: str
    reference: str
    first: str
    second: str
    better: int  # 0: `first` is the better answer, 1: `second`


def build_pairs() -> list[Pair]:
    pairs = []
    for i, (town, colour, fact) in enumerate(TOWNS):
        other = TOWNS[(i + 3) % len(TOWNS)][1]
        question = f"What color is the town hall of {town}?"
        reference = f"The town hall of {town} is painted {colour}. {fact}"
        right = f"The town hall of {town} is painted {colour}."
        wrong = f"The town hall of {town} is painted {other}."
        pairs.append(Pair(question, reference, right, wrong, better=0))
        pairs.append(Pair(question, reference, fact, right, better=1))
    return pairs


class ChatMeter(BaseEventHandler):
    """Counts chat calls and sums their usage, as SpanQueryLLM reports it in LlamaIndex's events."""

    usage: dict[str, float] = Field(default_factory=dict)

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.usage["calls"] = self.usage.get("calls", 0) + 1
            for key in ("prompt_tokens", "cached_tokens", "completion_tokens"):
                self.usage[key] = self.usage.get(key, 0) + (event.response.additional_kwargs.get(key) or 0)


Verdict = tuple[bool | None, float | None, str | None]  # (passing, score, feedback), as LlamaIndex's parsers
_MENTION = re.compile(
    r"\[\[\s*([ABC])\s*\]\]|\[\s*([ABC])\s*\]|\b(?:assistant|answer)\s+([AB])\b", re.IGNORECASE
)


def lenient_parser(output: str) -> Verdict:
    """`[[A]]` as LlamaIndex reads it; else the last `[A]`, `Assistant A` or `Answer A` (B and C alike)."""
    passing, score, feedback = strict_parser(output)
    if score is not None:
        return passing, score, feedback
    mentions = [next(g for g in m.groups() if g).upper() for m in _MENTION.finditer(output)]
    if not mentions:
        return None, None, None
    return {"A": (True, 1.0, ""), "B": (False, 0.0, ""), "C": (None, 0.5, "")}[mentions[-1]]


class RecordingParser:
    """A parser function that keeps every judge output it reads (the original call's, then the swapped one's)."""

    def __init__(self, parse: Callable[[str], Verdict]) -> None:
        self.parse = parse
        self.outputs: list[str] = []

    def __call__(self, output: str) -> Verdict:
        self.outputs.append(output)
        return self.parse(output)


def consensus_of(outputs: list[str], parse: Callable[[str], Verdict]) -> str:
    """The two-call consensus that `PairwiseComparisonEvaluator` resolves, read from its calls' outputs."""
    scores = [parse(o)[1] for o in outputs[:2]]
    if len(scores) < 2 or None in scores:
        return "invalid"
    votes_first = scores[0] + (1 - scores[1])
    votes_second = (1 - scores[0]) + scores[1]
    if votes_first == votes_second:
        return "tie"
    return "first" if votes_first > votes_second else "second"


def verdict(result: Any) -> str:
    """first / second / tie / invalid, for either evaluator's result."""
    if result.invalid_result or result.score is None:
        return "invalid"
    return {1.0: "first", 0.0: "second"}.get(result.score, "tie")


async def judge_all(pairs: list[Pair], llm: SpanQueryLLM, consensus_max_tokens: int) -> list[dict[str, Any]]:
    consensus_llm = llm.model_copy(update={"max_tokens": consensus_max_tokens})
    span_judge = SpanQueryPairwiseEvaluator(llm=llm, max_tokens=48)
    root = get_dispatcher()
    rows = []
    for pair in pairs:
        meter = ChatMeter()
        parser = RecordingParser(lenient_parser)
        consensus = PairwiseComparisonEvaluator(llm=consensus_llm, parser_function=parser)
        root.add_event_handler(meter)
        started = time.perf_counter()
        try:
            baseline = await consensus.aevaluate(
                query=pair.question,
                response=pair.first,
                second_response=pair.second,
                reference=pair.reference,
            )
        finally:
            root.event_handlers.remove(meter)
        baseline_s = time.perf_counter() - started

        started = time.perf_counter()
        spans = await span_judge.aevaluate(
            query=pair.question, response=pair.first, second_response=pair.second, reference=pair.reference
        )
        spans_s = time.perf_counter() - started
        rows.append(
            {
                "question": pair.question,
                "better": ("first", "second")[pair.better],
                "consensus": verdict(baseline),
                "consensus_strict": consensus_of(parser.outputs, strict_parser),
                "spans": verdict(spans),
                "consensus_usage": {**meter.usage, "wall_s": baseline_s},
                "spans_usage": {
                    "calls": spans.usage["calls"],
                    "prompt_tokens": spans.usage["prompt_tokens"],
                    "cached_tokens": spans.usage["cached_tokens"],
                    "completion_tokens": spans.usage["generated_tokens"],
                    "wall_s": spans_s,
                },
                "spans_copy": spans.response,
                "consensus_outputs": parser.outputs,
            }
        )
        print(
            f"{len(rows):>2} {pair.question[:44]:<44} better={rows[-1]['better']:<6} "
            f"strict={rows[-1]['consensus_strict']:<7} lenient={rows[-1]['consensus']:<7} "
            f"spans={rows[-1]['spans']:<7} "
            f"({baseline_s:.1f} s vs {spans_s:.1f} s)",
            flush=True,
        )
    return rows


CONSENSUS_READINGS = ("consensus_strict", "consensus")  # LlamaIndex's parser, the lenient one


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(rows)
    agreement = {}
    for reading in CONSENSUS_READINGS:
        decided = [r for r in rows if r[reading] in ("first", "second")]
        agreement[reading] = {
            "all_pairs": sum(r[reading] == r["spans"] for r in rows) / n,
            "decided_pairs": len(decided),
            "where_decided": sum(r[reading] == r["spans"] for r in decided) / len(decided)
            if decided
            else None,
        }
    totals = {
        side: {
            key: sum(r[f"{side}_usage"].get(key, 0) for r in rows)
            for key in ("calls", "prompt_tokens", "cached_tokens", "completion_tokens", "wall_s")
        }
        for side in ("consensus", "spans")
    }
    judges = (*CONSENSUS_READINGS, "spans")
    return {
        "pairs": n,
        "agreement": agreement,
        "accuracy": {j: sum(r[j] == r["better"] for r in rows) / n for j in judges},
        "verdicts": {
            j: {v: sum(r[j] == v for r in rows) for v in ("first", "second", "tie", "invalid")}
            for j in judges
        },
        "totals": totals,
    }


def print_summary(s: dict[str, Any]) -> None:
    names = {"consensus_strict": "strict consensus", "consensus": "lenient consensus", "spans": "span judge"}
    print(f"\n{s['pairs']} pairs")
    for reading in CONSENSUS_READINGS:
        a = s["agreement"][reading]
        where = f"{a['where_decided']:.0%}" if a["where_decided"] is not None else "-"
        print(
            f"span judge vs {names[reading]}: agrees on {a['all_pairs']:.0%} of all pairs, on {where} of the "
            f"{a['decided_pairs']} pairs the consensus decided"
        )
    for judge, counts in s["verdicts"].items():
        print(f"{names[judge]:<18} picked the better answer in {s['accuracy'][judge]:.0%}; verdicts {counts}")
    c, p = s["totals"]["consensus"], s["totals"]["spans"]
    print(f"\n{'':<22} {'consensus':>10} {'spans':>10} {'saved':>8}")
    for key, label in (
        ("calls", "calls"),
        ("prompt_tokens", "prompt tokens"),
        ("cached_tokens", "cached tokens"),
        ("completion_tokens", "generated tokens"),
        ("wall_s", "wall time (s)"),
    ):
        saved = "-" if key == "cached_tokens" or not c[key] else f"{1 - p[key] / c[key]:.0%}"
        print(f"{label:<22} {c[key]:>10.0f} {p[key]:>10.0f} {saved:>8}")


def main(argv: list[str] | None = None, backend: Any = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="default (SmolLM2), tiny, or a model folder")
    ap.add_argument("--pairs", type=int, default=16, help="how many of the 16 pairs to judge")
    ap.add_argument("--consensus-max-tokens", type=int, default=128, help="room for explanation + verdict")
    ap.add_argument("--json", help="also write the rows and the summary to this file")
    args = ap.parse_args(argv)

    started = None
    if backend is None and args.model != "default":
        from spanq_backend.serving.embedded import EmbeddedBackend

        backend = started = EmbeddedBackend(args.model)
    llm = SpanQueryLLM(backend=backend, temperature=0.0)  # LlamaIndex's own evaluator judges at the LLM's temperature
    llm.get_backend()  # start the engine first: the timings below are the judges' own
    try:
        rows = asyncio.run(judge_all(build_pairs()[: args.pairs], llm, args.consensus_max_tokens))
    finally:
        if started is not None:
            started.close()
    summary = summarize(rows)
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
