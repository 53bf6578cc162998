"""A warm query over documents read in context before, on a span engine (plugin on) and on stock vLLM (plugin off),
each engine alone in a process of its own, processes alternating: the time to first token of the call as each
engine runs it (the span engine given the documents in reverse order, stock in their first order: `spanq bench
rag`'s spans warm and stock canonical), and of the same stock prompt ids sent straight to the engine ("raw": the
engine's own step, no host work), each a median over `--reps` queries with new questions, after a cold query that
read the documents in context and the span engine's work when idle (`settle`) before every query.

    python scripts/warm_gap.py [--model default] [--docs 8] [--tokens 512] [--reps 12] [--rounds 3]

Run on older code from a worktree: `PYTHONPATH=../wt python scripts/warm_gap.py` (the script itself is read from
where it is; the engine from the path).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

QUESTIONS = [f"Which of the documents names item number {k} of the list? Answer with its number." for k in range(400)]


def _engine(plugin: bool, model: str, n: int, tokens: int, reps: int, out: multiprocessing.Queue) -> None:
    if not plugin:
        os.environ["SPANQ_DISABLE_PLUGIN"] = "1"
    if not os.environ.get("PYTHONPATH"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import asyncio

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from benchmarks.common import make_documents
    from benchmarks.rag import rag_query
    from spanq_backend import vllm_integration
    from spanq_backend.serving.embedded import EmbeddedBackend
    from spanq_backend.serving.engine import SpanEngine
    from spanq_integrations import aexecute

    engine = SpanEngine(model=model, spans=plugin, max_model_len=8192, max_num_seqs=16)
    assert vllm_integration._registered == plugin, "the plugin is not as this run asks"
    backend = EmbeddedBackend(model, engine=engine)
    docs = make_documents(engine.tokenizer, n, tokens, seed=7, start=5000)
    first = list(range(n))
    params = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    result: dict[str, list] = {"call": [], "raw": [], "lower": [], "how": []}

    async def run() -> None:
        await aexecute(rag_query(docs, first, QUESTIONS[0]), backend)  # cold: read in context
        for k in range(1, reps + 1):
            await asyncio.to_thread(engine.settle)
            order = list(reversed(first)) if plugin else first
            (call,) = (await aexecute(rag_query(docs, order, QUESTIONS[2 * k]), backend)).calls
            result["call"].append(call.ttft_s)
            result["lower"].append(call.extra["phases_s"]["lower"])
            result["how"].append(call.extra.get("cold_spans"))
            ids = engine.generator._lower(rag_query(docs, first, QUESTIONS[2 * k + 1]), stock=True)[0].token_ids
            await asyncio.to_thread(engine.settle)
            t0 = time.perf_counter()
            _, first_at = await engine.run_tokens(ids, params)
            result["raw"].append(first_at - t0)

    try:
        asyncio.run(run())
    finally:
        engine.close()
    out.put(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import spanq_backend

    print(f"spanq from {Path(spanq_backend.__file__).resolve().parents[1]}")
    ctx = multiprocessing.get_context("spawn")
    runs: dict[str, list[dict]] = {"spans": [], "stock": []}
    for r in range(args.rounds):
        for plugin in (True, False) if r % 2 == 0 else (False, True):  # alternate, so drift hits both
            out = ctx.Queue()
            proc = ctx.Process(target=_engine, args=(plugin, args.model, args.docs, args.tokens, args.reps, out))
            proc.start()
            result = out.get(timeout=1800)
            proc.join(timeout=120)
            name = "spans" if plugin else "stock"
            runs[name].append(result)
            print(f"round {r} {name}: call {statistics.median(result['call']) * 1e3:.1f} ms, raw "
                  f"{statistics.median(result['raw']) * 1e3:.1f} ms, lower {statistics.median(result['lower']) * 1e3:.2f} "
                  f"ms ({result['how'][0]})", flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median([x for run in runs[name] for x in run[key]]) * 1e3

    print(f"{args.docs} x {args.tokens} on {args.model}, medians over {args.rounds} rounds x {args.reps} queries:")
    for key in ("call", "raw", "lower"):
        spans, stock = med("spans", key), med("stock", key)
        print(f"  {key:>5}: spans {spans:7.2f} ms, stock {stock:7.2f} ms, stock / spans {stock / spans:.3f}")


if __name__ == "__main__":
    main()
