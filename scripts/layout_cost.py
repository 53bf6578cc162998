"""What a warm query costs on the host before its request: `SpanGenerator.layout` of a set of documents asked
again in another order with another question (`spanq bench rag`'s warm query), beside what the same call costs a
stock engine before its request (its prompt rendered and tokenized whole: `_lower(stock=True)`), on one engine,
each a median of `--reps` timings. The engine time is not in it: `spanq bench rag` measures the whole TTFT.

    python scripts/layout_cost.py [--model default] [--cells 1x64,8x64,8x128,8x512] [--reps 60]

Run on older code from a worktree: `PYTHONPATH=../wt python scripts/layout_cost.py` (the script itself is read
from where it is; the engine from the path).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--cells", default="1x64,8x64,8x128,8x512", help="documents x tokens, comma-separated")
    parser.add_argument("--reps", type=int, default=60)
    args = parser.parse_args()

    import spanq_backend
    from benchmarks.common import make_documents, settle
    from benchmarks.rag import QUESTION, SECOND_QUESTION, rag_query
    from spanq_backend.serving.embedded import EmbeddedBackend
    from spanq_integrations import execute

    print(f"spanq from {Path(spanq_backend.__file__).resolve().parents[1]}")
    backend = EmbeddedBackend(args.model, max_model_len=8192)
    gen = backend.engine.generator
    loop = asyncio.new_event_loop()

    def median_ms(fn) -> float:
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    print(f"{'docs x tokens':>13}  {'how':>10}  {'span engine layout ms':>21}  {'stock prompt ms':>15}  {'extra ms':>8}")
    start = 0
    try:
        for cell in args.cells.split(","):
            n, tokens = (int(x) for x in cell.split("x"))
            docs = make_documents(backend.engine.tokenizer, n, tokens, seed=0, start=start)
            start += n
            execute(rag_query(docs, range(n), QUESTION), backend)  # cold: read in context (or prepared alone)
            settle(backend)
            call = rag_query(docs, list(reversed(range(n))), SECOND_QUESTION)
            how = loop.run_until_complete(gen.layout(call)).mode
            spans = median_ms(lambda c=call: loop.run_until_complete(gen.layout(c)))
            stock = median_ms(lambda c=call: gen._lower(c, stock=True))
            print(f"{cell:>13}  {how:>10}  {spans:21.2f}  {stock:15.2f}  {spans - stock:8.2f}")
    finally:
        backend.close()


if __name__ == "__main__":
    main()
