"""Span reads of overlapping subsets, over and over, on one span engine: what `spanq bench rag`'s subset cells run,
made long enough to profile (`py-spy record`) and measured without a stock engine beside it.

`--docs` documents are read once in order and prepared as spans; then each repetition reads `--subset` of them,
a new random choice each time, for a question of its own, so that nothing of the answer is cached but the spans.
`--stock-factor 0` reads every call as spans (`SpanGenerator.STOCK_READ_FACTOR`); by default the engine chooses.
Prints the median TTFT and how the calls were read (`cold_spans`).

    .venv/bin/python scripts/subset_profile.py --model tiny --docs 24 --subset 15 --reps 120 --stock-factor 0
    py-spy record -r 400 -f raw -o profile.txt -- .venv/bin/python scripts/subset_profile.py ...   # where it goes
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` (not installed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--doc-tokens", type=int, default=64)
    ap.add_argument("--subset", type=int, default=15)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--stock-factor", type=float, default=None)
    args = ap.parse_args()

    from benchmarks.common import close_backend, make_backend, make_documents, ready, settle, ttft_of, warm_up
    from benchmarks.rag import QUESTION, rag_query
    from spanq_integrations import execute

    backend = make_backend(args.model, spans=True, max_model_len=8192, kv_cache_gib=1, max_num_seqs=16)
    try:
        warm_up(backend)
        if args.stock_factor is not None:
            backend.engine.generator.STOCK_READ_FACTOR = args.stock_factor
        docs = make_documents(backend.engine.tokenizer, args.docs, args.doc_tokens, seed=0, start=0)
        execute(rag_query(docs, list(range(args.docs)), QUESTION), backend)
        settle(backend)
        rng = random.Random(1)
        ttfts, modes = [], collections.Counter()
        for rep in range(args.reps):
            question = f"Which of the documents tells of well number {rep}? Answer with its number."
            ready(backend)
            (call,) = execute(rag_query(docs, rng.sample(range(args.docs), args.subset), question), backend).calls
            ttfts.append(ttft_of(call) * 1e3)
            modes[call.extra.get("cold_spans")] += 1
            settle(backend)
        print(f"{args.model}: {args.subset} of {args.docs} documents of {args.doc_tokens} tokens, {args.reps} calls: "
              f"TTFT median {statistics.median(ttfts):.1f} ms; read as {dict(modes)}")
    finally:
        close_backend(backend)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
