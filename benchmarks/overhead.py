"""`spanq bench overhead`: what the span plugin costs requests that carry no span table, and what the client side
costs a query before any model call.

- Engine: the same stock workload (prompts without spans, some sharing a prefix) runs on an embedded engine
  with the plugin loaded and on one with `SPANQ_DISABLE_PLUGIN=1`, each in a process of its own (started with
  multiprocessing's spawn: a fresh interpreter, so the plugin-off engine has none of spanq's hooks), one after
  the other per repetition. Measured: time to first token of single requests, and decode throughput of a
  batch of concurrent requests.
- Client: `optimize` + `lower` of a query over 32 fragments (no engine), per query.

Goal: requests without spans within 3% of plugin-off vLLM; the client side under 2 ms.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import BenchReport, base_parser, format_table, make_documents, positive_int, summarize

__all__ = ["main"]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = base_parser("overhead", __doc__, model="tiny", reps=3)
    parser.add_argument("--prompt-tokens", type=positive_int, default=1024, help="tokens per prompt (default: 1024)")
    parser.add_argument("--requests", type=positive_int, default=8, help="single requests timed per engine (default: 8)")
    parser.add_argument("--batch", type=positive_int, default=16, help="concurrent requests of the throughput run (16)")
    parser.add_argument("--decode-tokens", type=positive_int, default=64, help="tokens each batched request generates (64)")
    return parser.parse_args(list(argv))


def _engine_run(plugin: bool, model: str, prompts: list[list[int]], batch: int, decode: int, queue: Any) -> None:
    """In a spawned process: one engine, plugin on or off, the stock workload; results onto `queue`."""
    if not plugin:
        os.environ["SPANQ_DISABLE_PLUGIN"] = "1"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import asyncio

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from spanq_backend import vllm_integration
    from spanq_backend.serving.engine import SpanEngine

    engine = SpanEngine(model=model, spans=False, max_model_len=4096, max_num_seqs=max(16, batch))
    try:
        assert vllm_integration._registered == plugin, "the plugin state is not what this run measures"

        def params(n: int) -> Any:
            return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

        async def workload() -> dict[str, Any]:
            await engine.run_tokens(prompts[0][:64], params(1))  # warm-up
            ttfts = []
            for ids in prompts:
                t0 = time.perf_counter()
                _, first = await engine.run_tokens(ids, params(1))
                ttfts.append((first or time.perf_counter()) - t0)
            t0 = time.perf_counter()
            runs = await asyncio.gather(*(engine.run_tokens(prompts[i % len(prompts)][:256], params(decode))
                                          for i in range(batch)))
            wall = time.perf_counter() - t0
            generated = sum(len(o.outputs[0].token_ids) for outs, _ in runs for o in outs)
            return {"ttft_s": ttfts, "tokens_per_s": generated / wall}

        queue.put(asyncio.run(workload()))
    finally:
        engine.close()


def engine_side(model: str, prompts: list[list[int]], batch: int, decode: int, plugin: bool) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_engine_run, args=(plugin, model, prompts, batch, decode, queue))
    proc.start()
    try:
        result = queue.get(timeout=900)
    finally:
        proc.join(timeout=120)
    return result


def client_side(tokenizer: Any, reps: int) -> tuple[list[float], list[float]]:
    """Seconds per `optimize` + `lower` of a 32-fragment RAG query: fresh fragments (tokenized for the first
    time), and the same fragments again in another order (their tokens remembered)."""
    from spanq_backend.serving.lowering import lower
    from spanq_integrations import cross, fragment, generate, plus, system, user
    from spanq_integrations.optimizer import optimize
    from spanq_integrations.optimizer.context import BackendCapabilities

    caps = BackendCapabilities(name="embedded", span_aware=True, prepares_spans=True)
    pad = tokenizer.encode("\n", add_special_tokens=False)[-1]
    fresh, again = [], []
    for r in range(max(reps * 10, 20)):
        docs = make_documents(tokenizer, 32, 128, seed=r, start=r * 32)
        for order, times in ((docs, fresh), (docs[::-1], again)):
            query = generate(cross(system("Answer from the documents."), plus(*[fragment(d) for d in order]),
                                   user("Which one?")), max_tokens=8)
            t0 = time.perf_counter()
            plan = optimize(query, caps)
            lower(plan.input, tokenizer, 32, pad, 8192, 8)
            times.append(time.perf_counter() - t0)
    return fresh, again


def main(argv: Sequence[str] = ()) -> int:
    from spanq_backend.serving.generator import load_chat_tokenizer
    from spanq_backend.serving.models import resolve_model

    args = parse_args(argv)
    report = BenchReport("overhead", args)
    model = str(resolve_model(args.model))
    tokenizer = load_chat_tokenizer(model)
    shared = "You are a careful assistant. " * 20
    prompts = []
    for i, doc in enumerate(make_documents(tokenizer, args.requests, args.prompt_tokens, seed=args.seed)):
        text = (shared if i % 2 else "") + doc  # half of them share a prefix: prefix-cache hits too
        prompts.append(tokenizer.encode(text, add_special_tokens=False)[: args.prompt_tokens])
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for rep in range(args.reps):
        for mode in ("off", "on") if rep % 2 else ("on", "off"):  # alternate, so drift hits both
            result = engine_side(model, prompts, args.batch, args.decode_tokens, plugin=mode == "on")
            runs[mode].append(result)
            report.rows.append({"rep": rep, "plugin": mode, **result})
            print(f"rep {rep}: plugin {mode}: TTFT median {summarize(result['ttft_s'])['median'] * 1e3:.1f} ms, "
                  f"{result['tokens_per_s']:.1f} tokens/s")
    fresh, again = client_side(tokenizer, args.reps)

    def ttft(mode: str) -> dict[str, float]:
        return summarize([t for r in runs[mode] for t in r["ttft_s"]])

    def throughput(mode: str) -> dict[str, float]:
        return summarize([r["tokens_per_s"] for r in runs[mode]])

    on, off = ttft("on"), ttft("off")
    tp_on, tp_off = throughput("on"), throughput("off")
    report.summary = {
        "ttft_on": on, "ttft_off": off, "ttft_ratio": on["median"] / off["median"],
        "throughput_on": tp_on, "throughput_off": tp_off, "throughput_ratio": tp_on["median"] / tp_off["median"],
        "client_ms_fresh": {k: v * 1e3 if k != "n" else v for k, v in summarize(fresh).items()},
        "client_ms_again": {k: v * 1e3 if k != "n" else v for k, v in summarize(again).items()},
    }
    rows = [
        ["TTFT, single requests (ms, median)", f"{on['median'] * 1e3:.1f}", f"{off['median'] * 1e3:.1f}",
         f"{report.summary['ttft_ratio']:.3f}"],
        ["decode throughput (tokens/s, median)", f"{tp_on['median']:.1f}", f"{tp_off['median']:.1f}",
         f"{report.summary['throughput_ratio']:.3f}"],
    ]
    print(f"\noverhead on {args.model}: {args.requests} requests of {args.prompt_tokens} tokens, a batch of {args.batch} "
          f"x {args.decode_tokens} tokens, {args.reps} reps per engine (each in its own process)")
    print(format_table(["requests without spans", "plugin on", "plugin off", "on / off"], rows))
    for what, key in (("fresh fragments", "client_ms_fresh"), ("the same fragments reordered", "client_ms_again")):
        ms = report.summary[key]
        print(f"optimize + lower, 32 fragments of 128 tokens, {what}: {ms['median']:.2f} ms median, "
              f"{ms['p90']:.2f} ms p90")
    print("goals: requests without spans within 3% of plugin-off vLLM; the client side under 2 ms")
    report.write()
    report.print_files()
    return 0
