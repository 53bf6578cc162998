"""A judge ensemble on LangChain: N candidate answers and the judge over them, as one span query.

`JudgeEnsemble` generates `n` candidates (distinct seeds) as the children of a `plus`, so they run concurrently
and the judge (spanq's `select` reducer: it names the best candidate) reads each finished candidate as a span; `--k` turns on tree reduction (each judge reads k
candidates). The documents every generator reads are one `plus` of spans, computed once.

    .venv/bin/python examples/judge/langchain_judge.py                 # embedded default model (SmolLM2)
    .venv/bin/python examples/judge/langchain_judge.py --model tiny --n 4 --k 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spanq_integrations.langchain import ChatSpanQuery, JudgeEnsemble, JudgeVerdict

DOCUMENTS = Path(__file__).parent.parent / "rag" / "documents.json"
QUESTION = "Which town can only be reached by ferry, and from where?"


def run(
    llm: ChatSpanQuery, question: str = QUESTION, n: int = 4, k: int | None = 2, documents: int = 2
) -> JudgeVerdict:
    docs = [row["text"] for row in json.loads(DOCUMENTS.read_text())[:documents]]
    judge = JudgeEnsemble(llm=llm, n=n, k=k)
    return judge.invoke({"question": question, "documents": docs})


def report(verdict: JudgeVerdict) -> None:
    chosen = verdict.selection.index if verdict.selection else None
    for i, candidate in enumerate(verdict.candidates):
        print(f"{'*' if i == chosen else ' '} candidate {i}: {candidate.strip()}")
    if verdict.parsed is not None:
        print(f"\nverdict: {verdict.verdict.strip()}")
    else:  # SmolLM2-135M often cannot follow a judge's format (docs/haystack.md): say what it answered
        print(f"\nno verdict: {verdict.parse_error}")
    print(
        f"{len(verdict.calls)} calls (tree reduction k={verdict.k}); the judges read "
        f"{len(verdict.reused_outputs)} generated outputs as spans; the judges took "
        f"{verdict.judge_cached_tokens} prompt tokens from the cache"
    )
    print(f"{'call':<58} {'prompt':>6} {'cached':>6} {'spans':>5} {'TTFT s':>7}")
    for c in verdict.calls:
        ttft = f"{c.ttft_s:.2f}" if c.ttft_s is not None else "-"
        print(
            f"{c.path[:58]:<58} {c.prompt_tokens:>6} {c.cached_tokens:>6} {c.extra.get('spans', 0):>5} {ttft:>7}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="default (SmolLM2), tiny, or a model folder")
    ap.add_argument("--n", type=int, default=4, help="candidates")
    ap.add_argument("--k", type=int, default=2, help="tree reduction fan-in (0: one judge over all)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    backend = None  # the embedded default
    if args.model != "default":
        from spanq_backend.serving.embedded import EmbeddedBackend

        backend = EmbeddedBackend(args.model)
    llm = ChatSpanQuery(backend=backend, max_tokens=args.max_tokens)
    report(run(llm, n=args.n, k=args.k or None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
