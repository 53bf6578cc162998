"""`spanq bench cluster`: span-affinity routing vs Ray Serve's default routing, on a fleet of `spanq serve` replicas.

The workload (deterministic for a seed): a pool of `--pool` documents of about `--frag-tokens` tokens; document i
has popularity proportional to 1/(i+1)^s (Zipf, s = `--zipf`). Each of `--queries` RAG queries reads `--k`
distinct documents drawn by popularity, in the order drawn, and asks its own question; `--concurrency` queries
are in flight at a time. The same workload runs twice, each on a fresh cluster of `--replicas` replicas
(`spanq serve --replicas R --routing default|affinity`, each in its own processes): Ray Serve's own router
(power of two choices on queue length) and spanq's span-affinity router. Clients are `SpanBackend`s streaming
the answer; TTFT is measured on the client, through the cluster's HTTP proxy and ingress.

Reported per routing: span hit rate (the share of the queries' spans that no replica had to prepare), spans
prepared, mean and p90 TTFT, and the ratios affinity / default.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import BenchReport, base_parser, format_table, make_documents, new_figure, summarize

QUESTIONS = ["Which door?", "Which key?", "Which lamp?", "Which road?", "Which tree?", "Which bell?"]


def parse_args(argv: list[str]) -> Any:
    parser = base_parser("cluster", __doc__.split("\n\n")[0], reps=None)
    parser.add_argument("--replicas", type=int, default=2, help="replicas per cluster (default: 2)")
    parser.add_argument("--pool", type=int, default=32, help="documents in the shared pool (default: 32)")
    parser.add_argument("--frag-tokens", type=int, default=256, help="tokens per document (default: 256)")
    parser.add_argument("--k", type=int, default=4, help="documents per query (default: 4)")
    parser.add_argument("--queries", type=int, default=48, help="queries in the workload (default: 48)")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of document popularity (1.0)")
    parser.add_argument("--concurrency", type=int, default=2, help="queries in flight at a time (default: 2)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per query (default: 8)")
    return parser.parse_args(argv)


def workload(docs: list[str], args: Any) -> list[tuple[list[int], str]]:
    rng = random.Random(f"spanq-cluster:{args.seed}")
    weights = [1 / (i + 1) ** args.zipf for i in range(len(docs))]
    queries = []
    for q in range(args.queries):
        chosen: list[int] = []
        while len(chosen) < min(args.k, len(docs)):
            i = rng.choices(range(len(docs)), weights=weights)[0]
            if i not in chosen:
                chosen.append(i)
        queries.append((chosen, f"{QUESTIONS[q % len(QUESTIONS)]} (query {q})"))
    return queries


def _serve(argv: list[str], log: str) -> None:  # runs in the cluster's own process
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from spanq_integrations.cli import main as spanq_main

    raise SystemExit(spanq_main(argv))


def start_cluster(model: str, replicas: int, routing: str, log: Path) -> tuple[Any, str]:
    """A fresh cluster (`spanq serve --replicas R --routing X`) in a process of its own; waits until it answers."""
    from spanq_backend.cluster.app import free_port

    port = free_port()
    argv = ["serve", "--replicas", str(replicas), "--routing", routing, "--model", model, "--port", str(port)]
    proc = multiprocessing.get_context("spawn").Process(target=_serve, args=(argv, str(log)), name=f"cluster-{routing}")
    proc.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        if not proc.is_alive():
            raise RuntimeError(f"the {routing} cluster exited ({proc.exitcode}); see {log}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_cluster(proc)
            raise RuntimeError(f"the {routing} cluster did not start in 900 s; see {log}")
        time.sleep(2)


def stop_cluster(proc: Any) -> None:
    """SIGTERM (the cluster shuts its replicas and Ray down), then SIGKILL if it has not ended in 90 s."""
    proc.terminate()
    proc.join(timeout=90)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=10)


def run_workload(url: str, docs: list[str], queries: list[tuple[list[int], str]], args: Any) -> list[dict[str, Any]]:
    from spanq_integrations import cross, fragment, generate, plus, system, user
    from spanq_integrations.backends.span import SpanBackend
    from spanq_integrations.runtime.executor import aexecute

    async def go() -> list[dict[str, Any]]:
        gate = asyncio.Semaphore(args.concurrency)
        async with SpanBackend(url, max_concurrency=args.concurrency) as backend:

            async def one(q: int, chosen: list[int], question: str) -> dict[str, Any]:
                query = generate(
                    cross(system("Answer from the documents."), plus(*[fragment(docs[i]) for i in chosen]), user(question)),
                    max_tokens=args.max_tokens,
                    temperature=0.0,
                )
                async with gate:
                    result = await aexecute(query, backend)
                call = result.calls[0]
                return {"query": q, "spans": len(chosen), "prepared": call.prepared_spans, "ttft_s": call.ttft_s,
                        "cached_tokens": call.cached_tokens, "prompt_tokens": call.prompt_tokens}  # fmt: skip

            return await asyncio.gather(*(one(q, c, text) for q, (c, text) in enumerate(queries)))

    return asyncio.run(go())


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from spanq_backend.serving.generator import load_chat_tokenizer
    from spanq_backend.serving.models import resolve_model

    try:
        import ray.serve  # noqa: F401
    except ImportError:
        print("spanq bench cluster: needs the cluster extra: pip install 'spanq[cluster]'", file=sys.stderr)
        return 2
    model = str(resolve_model(args.model))
    docs = make_documents(load_chat_tokenizer(model), args.pool, args.frag_tokens, seed=args.seed)
    queries = workload(docs, args)
    report = BenchReport("cluster", args)
    logs = Path(tempfile.mkdtemp(prefix="spanq-bench-cluster-"))
    summary: dict[str, Any] = {}
    for routing in ("default", "affinity"):
        print(f"{routing}: starting {args.replicas} replicas …", file=sys.stderr, flush=True)
        proc, url = start_cluster(model, args.replicas, routing, logs / f"{routing}.log")
        try:
            rows = run_workload(url, docs, queries, args)
        finally:
            stop_cluster(proc)
        for row in rows:
            report.rows.append({"routing": routing, **row})
        spans = sum(r["spans"] for r in rows)
        prepared = sum(r["prepared"] for r in rows)
        ttft = summarize([r["ttft_s"] for r in rows])
        summary[routing] = {"hit_rate": 1 - prepared / spans, "prepared": prepared, "spans": spans,
                            "ttft_mean_s": ttft["mean"], "ttft_p90_s": ttft["p90"]}  # fmt: skip
    d, a = summary["default"], summary["affinity"]
    summary["hit_rate_ratio"] = a["hit_rate"] / d["hit_rate"] if d["hit_rate"] > 0 else float("inf")
    summary["ttft_speedup"] = d["ttft_mean_s"] / a["ttft_mean_s"]
    summary["distinct_documents"] = len({i for chosen, _ in queries for i in chosen})
    report.summary = summary
    rows = [
        [name, f"{s['hit_rate']:.3f}", s["prepared"], s["spans"], f"{s['ttft_mean_s'] * 1000:.0f}",
         f"{s['ttft_p90_s'] * 1000:.0f}"]
        for name, s in (("default (Ray Serve)", d), ("span affinity", a))
    ]  # fmt: skip
    print(format_table(["routing", "span hit rate", "prepared", "spans", "TTFT mean ms", "TTFT p90 ms"], rows))
    print(f"\n{args.queries} queries x {args.k} of {args.pool} documents ({summary['distinct_documents']} read), "
          f"{args.replicas} replicas, concurrency {args.concurrency}")  # fmt: skip
    print(f"span affinity / default: hit rate {summary['hit_rate_ratio']:.2f}x, mean TTFT {summary['ttft_speedup']:.2f}x faster")
    figure, axes = new_figure(2, width=9.0)
    names = ["default", "affinity"]
    axes[0].bar(names, [d["hit_rate"], a["hit_rate"]], color=["#999999", "#3a7ca5"])
    axes[0].set_ylabel("span hit rate")
    axes[1].bar(names, [d["ttft_mean_s"] * 1000, a["ttft_mean_s"] * 1000], color=["#999999", "#3a7ca5"])
    axes[1].set_ylabel("mean TTFT (ms)")
    figure.suptitle(f"{args.replicas} replicas, {args.queries} queries over {args.pool} documents (Zipf {args.zipf})")
    report.write(figure)
    report.print_files()
    return 0
