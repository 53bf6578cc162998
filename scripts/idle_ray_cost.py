"""What an idle Ray costs the engine steps of the process it runs in: the same greedy answer timed on an embedded
engine before Ray, with a local Ray joined and idle (as `run_bulk` left it until 2026-12-04), and after
`ray.shutdown()`.

    python scripts/idle_ray_cost.py [--model default] [--tokens 80] [--reps 3]

Prints each phase's times and its median against the first. Needs the cluster extra (Ray).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spanq_integrations import cross, execute, generate, system, user


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=80)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)

    import ray

    from spanq_backend.cluster.connect import connect
    from spanq_backend.serving.embedded import EmbeddedBackend

    backend = EmbeddedBackend(args.model)
    query = generate(cross(system("You are helpful."), user("Write a long story about a cat named Tom who travels.")),
                     max_tokens=args.tokens, temperature=0.0)  # fmt: skip
    execute(query, backend)  # warm-up: the prompt is cached from here on, so each run is its decode
    medians: list[float] = []

    def phase(label: str) -> None:
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            execute(query, backend)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
        print(f"{label:<22} {' '.join(f'{t:.2f}' for t in times)} s   median x{medians[-1] / medians[0]:.2f}", flush=True)

    try:
        phase("before Ray")
        connect(None)
        time.sleep(5)
        phase("Ray joined, idle")
        ray.shutdown()
        time.sleep(5)
        phase("after ray.shutdown()")
    finally:
        if ray.is_initialized():
            ray.shutdown()
        backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
