"""A cold query while deferred prepares wait for the engine: its time to first token, and whether they shared its
steps (docs/benchmarks.md, "Deferred prepares beside a call").

    python scripts/deferred_beside_calls.py --model default --reps 3

Per repetition: a query over `--docs` fresh documents of `--doc-tokens` tokens, its cold spans prepared alone first
(`cold_spans="isolate"`), starts; right after, `--backlog` prepares of other fresh documents are handed to the
engine to run when idle (what a query read in context leaves behind). Then the same query arriving `--arrive-after`
seconds after a long deferred prompt (`--long-tokens`: a stock prompt over a set, read in context again when idle)
was handed over and started; then the same query shape with nothing deferred.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import statistics

from benchmarks.common import make_documents
from spanq_backend.serving.engine import EngineConfig, SpanEngine
from spanq_integrations import cross, fragment, generate, plus, system, user


def query(docs: list[str]):
    return generate(cross(system("Answer from the documents."), plus(*[fragment(d) for d in docs]),
                          user("Which document mentions a river?")), max_tokens=4, temperature=0.0, cold_spans="isolate")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=256)
    parser.add_argument("--backlog", type=int, default=4, help="deferred prepares handed over beside the query")
    parser.add_argument("--backlog-tokens", type=int, default=512)
    parser.add_argument("--long-tokens", type=int, default=3072)
    parser.add_argument("--arrive-after", type=float, default=0.3)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with SpanEngine(EngineConfig(model=args.model, max_model_len=8192)) as engine:
        tok = engine.tokenizer
        asyncio.run(engine.generate(query(make_documents(tok, 2, 64, seed=9))))  # first-call costs out
        engine.settle(600)
        rows: dict[str, list[float]] = {"with a backlog": [], "arriving while a long one runs": [], "alone": []}

        async def scenario(docs: list[str], backlog: list[list[int]], before: float | None = None):
            if before is not None:  # handed over first, started while no call runs
                engine.run_when_idle([(p, concurrent.futures.Future()) for p in backlog])
                await asyncio.sleep(before)
            call = asyncio.ensure_future(engine.generate(query(docs)))
            await asyncio.sleep(0)  # the call is under way
            if backlog and before is None:
                engine.run_when_idle([(p, concurrent.futures.Future()) for p in backlog])
            return await call

        for rep in range(args.reps):
            for n, (case, ttfts) in enumerate(rows.items()):
                start = (rep * 3 + n) * (args.docs + args.backlog)
                docs = make_documents(tok, args.docs, args.doc_tokens, seed=1, start=start)
                if case == "with a backlog":
                    backlog = [engine.lower(query([d])).prepare_prompt(0) + [engine.pad_token_id]
                               for d in make_documents(tok, args.backlog, args.backlog_tokens, seed=2, start=start)]
                    done = asyncio.run(scenario(docs, backlog))
                elif case == "alone":
                    done = asyncio.run(scenario(docs, []))
                else:
                    long = tok.encode(" ".join(make_documents(tok, args.long_tokens // 256, 256, seed=3, start=start)),
                                      add_special_tokens=False)
                    done = asyncio.run(scenario(docs, [long], before=args.arrive_after))
                ttfts.append(done.metrics.ttft_s)
                engine.settle(600)
                print(json.dumps({"rep": rep, "case": case, "ttft_s": round(done.metrics.ttft_s, 3)}), flush=True)
        for case, ttfts in rows.items():
            print(f"{case}: TTFT median {statistics.median(ttfts):.3f} s ({', '.join(f'{t:.3f}' for t in ttfts)})")


if __name__ == "__main__":
    main()
