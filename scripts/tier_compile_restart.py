"""Compile new documents on engines restarted on a span tier that holds their anchor: how many blocks each compile
loads from the tier, and how long it takes (docs/benchmarks.md, `tier`, "Requests that load the same blocks at once").

    python scripts/tier_compile_restart.py --model default --docs 8 --reps 3

A first engine compiles two documents (the tier then holds the anchor); each repetition starts a new engine on the
same folder and compiles `--docs` documents it has never seen, one batch of prepares after that anchor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time

from spanq_backend.serving.engine import EngineConfig, SpanEngine

WORDS = ["river", "stone", "lamp", "market", "bridge", "orchard", "mill", "harbor", "bell", "tower", "field", "road"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--words", type=int, default=420, help="words per document")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(1)

    def doc(tag: str, i: int) -> str:
        return f"{tag} {i}. " + " ".join(rng.choice(WORDS) for _ in range(args.words))

    config = {"model": args.model, "tier_dir": tempfile.mkdtemp(prefix="spanq-tier-compile-"), "max_model_len": 4096}
    with SpanEngine(EngineConfig(**config)) as engine:
        asyncio.run(engine.compile([doc("First", i) for i in range(2)]))
    for rep in range(args.reps):
        with SpanEngine(EngineConfig(**config)) as engine:
            before = engine.tier_stats()["loaded_blocks"]
            started = time.perf_counter()
            report = asyncio.run(engine.compile([doc(f"Rep{rep}", i) for i in range(args.docs)]))
            print(json.dumps({"rep": rep, "compile_s": round(time.perf_counter() - started, 3),
                              "prepared": report["prepared"], "tokens": report["tokens"],
                              "loaded_blocks": engine.tier_stats()["loaded_blocks"] - before,
                              "written": report["blocks_written"]}), flush=True)


if __name__ == "__main__":
    main()
