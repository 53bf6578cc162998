"""`spanq bench cluster`: span-affinity routing vs Ray Serve's default routing, on a fleet of `spanq serve` replicas.

The workload (deterministic for a seed): a pool of `--pool` documents of about `--frag-tokens` tokens, split
into `--topics` topics of consecutive documents; topic t has popularity proportional to 1/(t+1)^s (Zipf, s =
`--zipf`). Each of `--queries` RAG queries picks a topic by popularity and reads `--k` distinct documents of it,
drawn uniformly, in the order drawn (what a retriever returns for questions on one subject: overlapping sets of
that subject's documents), and asks its own question; `--concurrency` queries are in flight at a time.
`--topics 0`: no topics, document i itself has popularity 1/(i+1)^s and a query's k documents are drawn
independently (nothing a router can partition: most queries read hot documents that every replica needs).

Each replica's KV cache holds `--replica-blocks` blocks (vLLM's `--num-gpu-blocks-override`, given to every
replica's `spanq serve`); the defaults make the pool larger than one replica's cache but smaller than the fleet's:
a router that sends a topic's queries to one replica lets each replica cache its share of the pool, one that
spreads them makes every replica cache the whole pool, which does not fit, and evicts.

The same workload runs twice, each on a fresh cluster of `--replicas` replicas (`spanq serve --replicas R
--routing default|affinity`, each in its own processes): Ray Serve's own router (power of two choices on queue
length) and spanq's span-affinity router. Clients are `SpanBackend`s streaming the answer; TTFT is measured on
the client, through the cluster's HTTP proxy and ingress.

Reported per routing: span hit rate (the share of the queries' spans that no replica had to prepare), spans
prepared, mean and p90 TTFT, and the ratios affinity / default; and the pool's size in KV blocks next to the
replicas' capacity.
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

from benchmarks.common import (
    BenchReport,
    base_parser,
    faster,
    format_table,
    make_documents,
    new_figure,
    positive_int,
    summarize,
)
from spanq_backend.serving.cluster_options import non_negative_int

# Per replica: 65% of the default pool's 513 blocks, so one replica cannot hold it all; the fleet's 672 hold it with
# room for what running queries add (a replica caching its half, 257 blocks, has 79 to spare).
REPLICA_BLOCKS = 336
READY = "spanq serve: ready on"  # what `spanq serve --replicas` prints once all its replicas run
QUESTIONS = ["Which door?", "Which key?", "Which lamp?", "Which road?", "Which tree?", "Which bell?"]


def parse_args(argv: list[str]) -> Any:
    parser = base_parser("cluster", __doc__, reps=None)
    parser.add_argument("--replicas", type=positive_int, default=2, help="replicas per cluster (default: 2)")
    parser.add_argument("--pool", type=positive_int, default=64, help="documents in the shared pool (default: 64)")
    parser.add_argument("--frag-tokens", type=positive_int, default=256, help="tokens per document (default: 256)")
    parser.add_argument("--topics", type=non_negative_int, default=8,
                        help="topics the pool is split into; 0: documents drawn independently (default: 8)")  # fmt: skip
    parser.add_argument("--k", type=positive_int, default=4, help="documents per query (default: 4)")
    parser.add_argument("--queries", type=positive_int, default=480, help="queries in the workload (default: 480)")
    parser.add_argument("--zipf", type=float, default=0.8, help="Zipf exponent of topic (or document) popularity (0.8)")
    parser.add_argument("--concurrency", type=positive_int, default=4, help="queries in flight at a time (default: 4)")
    parser.add_argument("--max-tokens", type=positive_int, default=8, help="tokens generated per query (default: 8)")
    parser.add_argument("--replica-blocks", type=int, default=REPLICA_BLOCKS,
                        help="KV cache blocks per replica (vLLM's --num-gpu-blocks-override); 0: vLLM's own size, "
                        f"from spanq serve's 1 GiB (default: {REPLICA_BLOCKS})")  # fmt: skip
    parser.add_argument("--max-imbalance", type=int, default=None,
                        help="the affinity router's queue-length bound (default: spanq serve's)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.topics < 0 or (args.topics and (args.pool // args.topics) < args.k):
        parser.error(f"--topics {args.topics}: each of them needs at least --k {args.k} of the {args.pool} documents")
    return args


def topic_of(doc: int, args: Any) -> int:
    """The topic of document `doc`: topic t holds documents t*m .. t*m+m-1, m = pool // topics (the last one the
    rest); with no topics, each document is its own."""
    if not args.topics:
        return doc
    return min(doc // (args.pool // args.topics), args.topics - 1)


def workload(docs: list[str], args: Any) -> list[tuple[list[int], str]]:
    rng = random.Random(f"spanq-cluster:{args.seed}")
    queries = []
    if args.topics:
        members = [[i for i in range(len(docs)) if topic_of(i, args) == t] for t in range(args.topics)]
        weights = [1 / (t + 1) ** args.zipf for t in range(args.topics)]
        for q in range(args.queries):
            topic = rng.choices(range(args.topics), weights=weights)[0]
            chosen = rng.sample(members[topic], min(args.k, len(members[topic])))
            queries.append((chosen, f"{QUESTIONS[q % len(QUESTIONS)]} (query {q})"))
        return queries
    weights = [1 / (i + 1) ** args.zipf for i in range(len(docs))]
    for q in range(args.queries):
        chosen: list[int] = []
        while len(chosen) < min(args.k, len(docs)):
            i = rng.choices(range(len(docs)), weights=weights)[0]
            if i not in chosen:
                chosen.append(i)
        queries.append((chosen, f"{QUESTIONS[q % len(QUESTIONS)]} (query {q})"))
    return queries


def span_blocks(tokenizer: Any, docs: list[str], block_size: int) -> list[int]:
    """KV blocks each document's span takes (its tokens, padded to whole blocks; the anchor's are shared)."""
    return [-(-len(tokenizer.encode(d, add_special_tokens=False)) // block_size) for d in docs]


def _serve(argv: list[str], log: str) -> None:  # runs in the cluster's own process
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from spanq_integrations.cli import main as spanq_main

    raise SystemExit(spanq_main(argv))


def start_cluster(
    model: str, replicas: int, routing: str, log: Path, extra: list[str] | None = None
) -> tuple[Any, str]:
    """A fresh cluster (`spanq serve --replicas R --routing X [extra]`) in a process of its own; waits until it
    answers. `extra`: more `spanq serve` options (the cluster's, and the replicas' own)."""
    from spanq_backend.cluster.app import free_port

    port = free_port()
    argv = ["serve", "--replicas", str(replicas), "--routing", routing, "--model", model, "--port", str(port)]
    argv += extra or []
    proc = multiprocessing.get_context("spawn").Process(target=_serve, args=(argv, str(log)), name=f"cluster-{routing}")
    proc.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, routing, log)
    except BaseException:
        stop_cluster(proc)
        raise
    return proc, url


def _wait_ready(proc: Any, url: str, routing: str, log: Path, timeout_s: float = 900) -> None:
    """Until every replica of the cluster runs: `spanq serve` says so once Ray Serve reports the application
    running. (Its address answers as soon as one replica does; a workload started then goes all to that one.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        if not proc.is_alive():
            raise RuntimeError(f"the {routing} cluster exited ({proc.exitcode}); see {log}")
        try:
            if READY in log.read_text(errors="replace"):
                with urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                    time.sleep(2)  # for the ingress's router to hear of the last replica
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {routing} cluster did not start in {timeout_s:.0f} s; see {log}")
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
                return {"query": q, "spans": len(chosen), "prepared": call.prepared_spans + call.deferred_spans, "ttft_s": call.ttft_s,
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
    from spanq_backend.serving.server import SERVE_DEFAULTS

    model = str(resolve_model(args.model))
    tokenizer = load_chat_tokenizer(model)
    docs = make_documents(tokenizer, args.pool, args.frag_tokens, seed=args.seed)
    queries = workload(docs, args)
    block_size = int(SERVE_DEFAULTS["block_size"])
    blocks = span_blocks(tokenizer, docs, block_size)
    pool_blocks = sum(blocks) + 1  # and the anchor's block, which every span shares
    # a query's prompt: its k spans, the anchor, the system prompt and question, the answer (a few blocks)
    query_blocks = max(sum(blocks[i] for i in chosen) for chosen, _ in queries) + 4
    # vLLM refuses to start an engine whose cache cannot hold one request of the longest length it accepts
    least = max(query_blocks, -(-int(SERVE_DEFAULTS["max_model_len"]) // block_size))
    if args.replica_blocks and args.replica_blocks < least:
        print(f"spanq bench cluster: --replica-blocks must be at least {least} (one query's prompt takes up to "
              f"{query_blocks} blocks; vLLM wants room for one {SERVE_DEFAULTS['max_model_len']}-token request)",
              file=sys.stderr)  # fmt: skip
        return 2
    extra = ["--num-gpu-blocks-override", str(args.replica_blocks)] if args.replica_blocks else []
    report = BenchReport("cluster", args)
    report.config.update(pool_blocks=pool_blocks, query_blocks=query_blocks, block_size=block_size)
    logs = Path(tempfile.mkdtemp(prefix="spanq-bench-cluster-"))
    summary: dict[str, Any] = {"pool_blocks": pool_blocks}
    for routing in ("default", "affinity"):
        print(f"{routing}: starting {args.replicas} replicas …", file=sys.stderr, flush=True)
        options = list(extra)
        if routing == "affinity" and args.max_imbalance is not None:
            options = ["--max-imbalance", str(args.max_imbalance), *options]
        proc, url = start_cluster(model, args.replicas, routing, logs / f"{routing}.log", options)
        try:
            began = time.perf_counter()
            rows = run_workload(url, docs, queries, args)
            wall = time.perf_counter() - began
        finally:
            stop_cluster(proc)
        for row in rows:
            report.rows.append({"routing": routing, **row})
        spans = sum(r["spans"] for r in rows)
        prepared = sum(r["prepared"] for r in rows)
        ttft = summarize([r["ttft_s"] for r in rows])
        summary[routing] = {"hit_rate": 1 - prepared / spans, "prepared": prepared, "spans": spans,
                            "ttft_mean_s": ttft["mean"], "ttft_p90_s": ttft["p90"],
                            "workload_s": wall}  # fmt: skip
    d, a = summary["default"], summary["affinity"]
    summary["hit_rate_ratio"] = a["hit_rate"] / d["hit_rate"] if d["hit_rate"] > 0 else float("inf")
    summary["ttft_speedup"] = d["ttft_mean_s"] / a["ttft_mean_s"]
    summary["distinct_documents"] = len({i for chosen, _ in queries for i in chosen})
    report.summary = summary
    rows = [
        [name, f"{s['hit_rate']:.3f}", s["prepared"], s["spans"], f"{s['ttft_mean_s'] * 1000:.0f}",
         f"{s['ttft_p90_s'] * 1000:.0f}", f"{s['workload_s']:.0f}"]
        for name, s in (("default (Ray Serve)", d), ("span affinity", a))
    ]  # fmt: skip
    print(format_table(["routing", "span hit rate", "prepared", "spans", "TTFT mean ms", "TTFT p90 ms", "wall s"], rows))
    topics = f"{args.topics} topics, " if args.topics else "no topics, "
    print(f"\n{args.queries} queries x {args.k} of {args.pool} documents ({topics}Zipf {args.zipf}; "
          f"{summary['distinct_documents']} read), {args.replicas} replicas, concurrency {args.concurrency}")  # fmt: skip
    capacity = f"{args.replica_blocks} blocks" if args.replica_blocks else "vLLM's own size (1 GiB)"
    print(f"KV cache: the pool takes {pool_blocks} blocks of {block_size} tokens, one query's prompt up to "
          f"{query_blocks}; each replica holds {capacity}"
          + (f" ({args.replicas * args.replica_blocks} in the fleet)" if args.replica_blocks else ""))  # fmt: skip
    print(f"span affinity against default: hit rate {summary['hit_rate_ratio']:.2f}x default's, mean TTFT "
          f"{faster(summary['ttft_speedup'])}")
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
