"""An order-free LLM judge in LlamaIndex: `SpanQueryPairwiseEvaluator` on the embedded default model.

It is a drop-in for `PairwiseComparisonEvaluator`: `evaluate(query, response, second_response, reference)`
returns score 1.0 when `response` is better, 0.0 when `second_response` is. It asks once, the two answers an
order-free `plus` of spans, instead of twice with the answers swapped; swapping them here gives the mirrored
verdict by construction. `aselect` picks the best of many candidates with a pairwise tree of judges.

    .venv/bin/python examples/judge/llamaindex_judge.py [--model default|tiny|PATH]
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from spanq_integrations.llamaindex import SpanQueryLLM, SpanQueryPairwiseEvaluator

QUESTION = "What color is the town hall of Corrow Ridge?"
REFERENCE = (
    "Corrow Ridge is an old mining town. The town hall is painted dark red, the color of the iron ore."
)
CANDIDATES = [
    "The town hall of Corrow Ridge is painted dark red.",
    "The town hall of Corrow Ridge is painted sea green.",
    "Corrow Ridge is an old mining town in the mountains.",
    "I do not know.",
]


def main(argv: list[str] | None = None, backend: Any = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="default (SmolLM2), tiny, or a model folder")
    args = ap.parse_args(argv)

    started = None
    if backend is None and args.model != "default":
        from spanq_backend.serving.embedded import EmbeddedBackend

        backend = started = EmbeddedBackend(args.model)
    judge = SpanQueryPairwiseEvaluator(llm=SpanQueryLLM(backend=backend), max_tokens=48)
    try:
        forward = judge.evaluate(
            query=QUESTION, response=CANDIDATES[0], second_response=CANDIDATES[1], reference=REFERENCE
        )
        swapped = judge.evaluate(
            query=QUESTION, response=CANDIDATES[1], second_response=CANDIDATES[0], reference=REFERENCE
        )
        best = asyncio.run(judge.aselect(QUESTION, CANDIDATES, reference=REFERENCE))
    finally:
        if started is not None:
            started.close()

    for name, result in (("A vs B", forward), ("B vs A", swapped)):
        print(f"{name}: score={result.score} (judge copied {result.response.strip()!r})")
        print(
            f"        {result.usage['calls']} call, {result.usage['prompt_tokens']} prompt tokens, "
            f"{result.usage['cached_tokens']} cached"
        )
    winner = CANDIDATES[best.choice] if best.choice is not None else "(no decision)"
    print(f"\nbest of {len(CANDIDATES)}: {winner}")
    print(
        f"        {best.usage['calls']} calls (pairwise tree), {best.usage['prompt_tokens']} prompt tokens, "
        f"{best.usage['cached_tokens']} cached"
    )
    return {"forward": forward, "swapped": swapped, "best": best}


if __name__ == "__main__":
    main()
