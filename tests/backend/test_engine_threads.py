"""An idle embedded engine keeps no OpenMP workers: libgomp throttles the spinning of every team in a process once
its workers outnumber the CPUs, so an idle engine's sleeping team would slow a busy engine's every step
(x1.42 measured: `python scripts/idle_cost.py engines`, spanq_backend/vllm_integration/openmp.py)."""

from __future__ import annotations

import os
import threading
import time

import torch

from spanq_backend.serving.engine import ENGINE_THREAD_NAME
from spanq_backend.vllm_integration import openmp
from spanq_integrations import execute, generate, user


def named(name: str) -> set[str]:
    """This process's threads the OS knows by `name`: a thread named so, the OpenMP workers it started, and any
    thread it started (they take its name)."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().strip() == name:
                    found.add(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return found


def settled(name: str, expected: set[str], within: float = 5.0) -> set[str]:
    """The threads named `name` once they are `expected` (or after `within` seconds, whichever they are)."""
    deadline = time.monotonic() + within
    while (found := named(name)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def steady(name: str, quiet: float = 0.5) -> set[str]:
    """The threads named `name` once they have not changed for `quiet` seconds."""
    found, since = named(name), time.monotonic()
    while time.monotonic() - since < quiet:
        time.sleep(0.05)
        if (now := named(name)) != found:
            found, since = now, time.monotonic()
    return found


def test_a_thread_that_releases_its_openmp_workers_keeps_none():
    seen: dict[str, int] = {}
    a = torch.randn(512, 512)

    def body() -> None:
        openmp.name_this_thread("spanq-omp-test")
        a @ a  # a parallel region: this thread starts a team, whose workers take its name
        seen["working"] = len(named("spanq-omp-test"))
        seen["released"] = openmp.release_workers()
        seen["after"] = len(named("spanq-omp-test"))
        a @ a  # the next region starts a new team
        seen["again"] = len(named("spanq-omp-test"))
        openmp.release_workers()

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert torch.get_num_threads() > 1, "one OpenMP thread: nothing to release on this machine"
    assert seen == {"working": torch.get_num_threads(), "released": True, "after": 1,
                    "again": torch.get_num_threads()}  # fmt: skip


def test_an_engine_gone_idle_keeps_no_openmp_workers_and_one_that_keeps_them_is_seen(tiny_backend, monkeypatch):
    query = generate(user("Count to twenty."), max_tokens=24, temperature=0.0)
    execute(query, tiny_backend)
    idle = steady(ENGINE_THREAD_NAME)  # the engine thread and the threads it started
    execute(query, tiny_backend)
    assert settled(ENGINE_THREAD_NAME, idle) == idle, "the engine thread kept OpenMP workers after its answer"

    # The check can fail: an engine that does not hand its workers back leaves them alive after the answer.
    monkeypatch.setattr(openmp, "release_workers", lambda: False)
    execute(query, tiny_backend)
    assert len(settled(ENGINE_THREAD_NAME, idle, within=1.0) - idle) == torch.get_num_threads() - 1
    monkeypatch.undo()
    execute(query, tiny_backend)
    assert settled(ENGINE_THREAD_NAME, idle) == idle


def test_a_caller_that_ran_torch_before_its_query_keeps_no_openmp_workers_through_it(tiny_backend, monkeypatch):
    """An application that embeds its documents on the thread that then asks the engine (the usual RAG app) would
    otherwise throttle every step of the answer (x1.50: `python scripts/idle_cost.py thread`)."""
    query = generate(user("Count to twenty."), max_tokens=8, temperature=0.0)
    a = torch.randn(512, 512)
    seen: dict[str, int] = {}

    def app(key: str) -> None:
        openmp.name_this_thread("spanq-app-test")
        a @ a  # the application's own torch work: this thread now has a team
        seen[f"{key} before"] = len(named("spanq-app-test"))
        execute(query, tiny_backend)
        seen[f"{key} after"] = len(named("spanq-app-test"))
        openmp.release_workers()

    def run(key: str) -> None:
        thread = threading.Thread(target=app, args=(key,))
        thread.start()
        thread.join()

    run("released")
    monkeypatch.setattr(openmp, "release_workers", lambda: False)  # the check can fail: a backend that does not
    run("kept")
    monkeypatch.undo()
    execute(query, tiny_backend)  # the engine, whose release was off too, hands its team back for the tests after
    assert seen == {"released before": torch.get_num_threads(), "released after": 1,
                    "kept before": torch.get_num_threads(), "kept after": torch.get_num_threads()}  # fmt: skip
