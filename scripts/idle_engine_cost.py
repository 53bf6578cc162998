"""What idle embedded engines cost a busy one in the same process: the same greedy answer timed on an engine
alone, beside `--others` idle tiny engines (each started and asked once), and after they are closed, with each
phase's voluntary context switches of the process's threads (OpenMP threads that sleep at each parallel region
instead of spinning show there, not in CPU time).

    python scripts/idle_engine_cost.py [--model default] [--others 2] [--tokens 80] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spanq_integrations import cross, execute, generate, system, user


def switches() -> tuple[int, int]:
    """The process's threads' CPU ticks and voluntary context switches, summed."""
    ticks = voluntary = 0
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            stat = Path(f"/proc/{os.getpid()}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/{os.getpid()}/task/{tid}/status").read_text().splitlines()
        except OSError:
            continue
        ticks += int(stat[11]) + int(stat[12])
        voluntary += next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))
    return ticks, voluntary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--others", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=80)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)

    from spanq_backend.serving.embedded import EmbeddedBackend

    backend = EmbeddedBackend(args.model)
    query = generate(cross(system("You are helpful."), user("Write a long story about a cat named Tom who travels.")),
                     max_tokens=args.tokens, temperature=0.0)  # fmt: skip
    execute(query, backend)  # warm-up: the prompt is cached from here on, so each run is its decode
    medians: list[float] = []

    def phase(label: str) -> None:
        before = switches()
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            execute(query, backend)
            times.append(time.perf_counter() - start)
        after = switches()
        medians.append(statistics.median(times))
        print(f"{label:<24} {' '.join(f'{t:.2f}' for t in times)} s   median x{medians[-1] / medians[0]:.2f}   "
              f"CPU ticks {after[0] - before[0]}, voluntary switches {after[1] - before[1]}", flush=True)  # fmt: skip

    others = []
    try:
        phase("alone")
        others = [EmbeddedBackend("tiny", max_model_len=2048, kv_cache_gib=0.25) for _ in range(args.others)]
        for other in others:
            execute(generate(user("hi"), max_tokens=2), other)
        time.sleep(3)
        phase(f"beside {args.others} idle engines")
        for other in others:
            other.close()
        others = []
        time.sleep(3)
        phase("after closing them")
    finally:
        for other in others:
            other.close()
        backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
