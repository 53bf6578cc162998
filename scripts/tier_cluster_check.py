"""Replicas on a shared span tier: a corpus compiled by `spanq prepare`, then a cluster started on the same folder
(`spanq serve --replicas N --tier-dir DIR`, replicas that never saw the corpus), and its first queries over the
corpus: how many of the spans they read were computed (prepared, or read in context) and how many came from the
tier or a replica's cache.

    python scripts/tier_cluster_check.py [--model tiny] [--replicas 2] [--docs 8] [--queries 10] [--per-query 3]

Prints one line per query and the span hit rate over them (the span tier issue's goal: >= 0.9 over a new
replica's first 10 queries), with the cluster's `spanq_tier_*` counters. Needs the cluster extra (Ray).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from spanq_integrations import cross, fragment, generate, plus, system, user
from spanq_integrations.query.spnl_json import to_json

WORDS = ["key", "door", "lamp", "road", "tree", "bell", "cup"]


def documents(n: int) -> list[str]:
    return [f"Document {i}. " + " ".join(f"The {w} of {i} is {j}." for j, w in enumerate(WORDS * 3)) for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--queries", type=int, default=10)
    parser.add_argument("--per-query", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    spanq = [sys.executable, "-m", "spanq_integrations.cli"]
    with tempfile.TemporaryDirectory(prefix="spanq-tier-cluster-") as work:
        tier_dir, corpus = Path(work) / "tier", Path(work) / "corpus.jsonl"
        docs = documents(args.docs)
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        compiled = subprocess.run([*spanq, "prepare", str(corpus), "--tier-dir", str(tier_dir), "--model", args.model,
                                   "--json"], capture_output=True, text=True, check=False)  # fmt: skip
        if compiled.returncode != 0:
            print(compiled.stderr[-3000:], file=sys.stderr)
            return 1
        print("compiled:", compiled.stdout.strip().splitlines()[-1])
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(Path(work) / "serve.log", "wb") as log:
            server = subprocess.Popen([*spanq, "serve", "--model", args.model, "--port", str(port), "--tier-dir",
                                       str(tier_dir), "--replicas", str(args.replicas)],
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 900
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    print((Path(work) / "serve.log").read_text()[-3000:], file=sys.stderr)
                    return 1
                time.sleep(1)
            rng = random.Random(args.seed)
            read = computed = 0
            for i in range(args.queries):
                chosen = rng.sample(docs, args.per_query)
                call = generate(cross(system("Answer from the documents."), plus(*[fragment(d) for d in chosen]),
                                      user(f"Which door is open, question {i}?")),
                                max_tokens=5, temperature=0.0, model=args.model)  # fmt: skip
                answer = httpx.post(f"{url}/v1/query/execute", json=to_json(call), timeout=600)
                usage = answer.json().get("usage") or {}
                new = usage.get("prepared_spans", 0) + usage.get("deferred_spans", 0)
                read, computed = read + len(chosen), computed + new
                print(f"query {i}: HTTP {answer.status_code}, {len(chosen)} spans, {new} computed, "
                      f"{usage.get('prompt_tokens_details', {}).get('cached_tokens')} of {usage.get('prompt_tokens')} "
                      "prompt tokens cached", flush=True)
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
            print("\n".join(line for line in metrics.splitlines() if line.startswith("spanq_tier_")))
            print(f"span hit rate over the first {args.queries} queries: {(read - computed) / read:.3f} "
                  f"({read - computed} of {read} spans not computed; goal >= 0.9)")
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
