"""What an idle neighbour in the same process costs an embedded engine's steps: the same greedy answer timed on an
engine alone, beside the neighbour left idle, and after it is gone, with each phase's CPU ticks and voluntary
context switches of the process's live threads (threads that sleep and wake at each parallel region instead of
running show there, not in CPU time; threads that ended, such as an engine's OpenMP workers handed back when it went
idle, are not counted).

    python scripts/idle_cost.py ray [--model default] [--tokens 80] [--reps 5]
    python scripts/idle_cost.py engines [--others 2] [--model default] [--tokens 80] [--reps 5]
    python scripts/idle_cost.py thread [--model default] [--tokens 80] [--reps 5]

`ray`: a local Ray joined and idle (as `run_bulk` left it until 2026-12-04), then `ray.shutdown()`.
`engines`: `--others` idle tiny embedded engines (each started and asked once), then closed.
`thread`: a thread that ran one torch parallel operator and waits (an OpenMP team of its own), then ended.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spanq_integrations import cross, execute, generate, system, user


def counters() -> tuple[int, int]:
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


def ray_neighbour(args: argparse.Namespace) -> tuple[str, Callable[[], None], Callable[[], None]]:
    import ray

    from spanq_backend.cluster.connect import connect

    def stop() -> None:
        if ray.is_initialized():
            ray.shutdown()

    return "a local Ray, idle", lambda: connect(None), stop


def engine_neighbours(args: argparse.Namespace) -> tuple[str, Callable[[], None], Callable[[], None]]:
    from spanq_backend.serving.embedded import EmbeddedBackend

    others: list[EmbeddedBackend] = []

    def start() -> None:
        for _ in range(args.others):
            others.append(EmbeddedBackend("tiny", max_model_len=2048, kv_cache_gib=0.25))
            execute(generate(user("hi"), max_tokens=2), others[-1])

    def stop() -> None:
        while others:
            others.pop().close()

    return f"{args.others} idle tiny engines", start, stop


def thread_neighbour(args: argparse.Namespace) -> tuple[str, Callable[[], None], Callable[[], None]]:
    import threading

    import torch

    done = threading.Event()

    def parked() -> None:
        a = torch.randn(512, 512)
        a @ a  # one parallel region: this thread now has an OpenMP team of its own
        done.wait()

    thread = threading.Thread(target=parked, daemon=True)

    def stop() -> None:
        done.set()
        if thread.is_alive():
            thread.join()

    return "a thread that ran one matrix product, parked", thread.start, stop


NEIGHBOURS = {"ray": ray_neighbour, "engines": engine_neighbours, "thread": thread_neighbour}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("neighbour", choices=sorted(NEIGHBOURS))
    parser.add_argument("--model", default="default")
    parser.add_argument("--others", type=int, default=2, help="engines: how many idle tiny engines")
    parser.add_argument("--tokens", type=int, default=80)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)

    from spanq_backend.serving.embedded import EmbeddedBackend

    what, start, stop = NEIGHBOURS[args.neighbour](args)
    backend = EmbeddedBackend(args.model)
    query = generate(cross(system("You are helpful."), user("Write a long story about a cat named Tom who travels.")),
                     max_tokens=args.tokens, temperature=0.0)  # fmt: skip
    execute(query, backend)  # warm-up: the prompt is cached from here on, so each run is its decode
    medians: list[float] = []

    def phase(label: str) -> None:
        before = counters()
        times = []
        for _ in range(args.reps):
            begin = time.perf_counter()
            execute(query, backend)
            times.append(time.perf_counter() - begin)
        after = counters()
        medians.append(statistics.median(times))
        print(f"{label:<30} {' '.join(f'{t:.2f}' for t in times)} s   median x{medians[-1] / medians[0]:.2f}   "
              f"CPU ticks {after[0] - before[0]}, voluntary switches {after[1] - before[1]}", flush=True)  # fmt: skip

    try:
        phase("alone")
        start()
        time.sleep(5)
        phase(f"beside {what}")
        stop()
        time.sleep(5)
        phase("after it is gone")
    finally:
        stop()
        backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
