"""Work started ahead of the test that checks it, in the background, one job at a time (tests/conftest.py calls a
module's `start_ahead(items)` once the session's tests are collected). For jobs that run in processes of their
own (an example or a notebook as a user runs it): on this 2-core machine a test session leaves a core idle much
of the time, and one background job at a time uses it without crowding the tests in the foreground: every
process started ahead runs at the lowest CPU priority (`in_background`), so it takes only what
the foreground leaves (vLLM's CPU engines spin on both cores; two at one priority slow each other down)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_POOL: ThreadPoolExecutor | None = None


def in_background(command: Sequence[str]) -> list[str]:
    """`command` run at the lowest CPU priority, it and all it starts (the process keeps the pid `nice` had)."""
    return ["nice", "-n", "19", *command]

_JOBS: dict[Hashable, Future] = {}


def submit(key: Hashable, job: Callable[[], Any]) -> None:
    """Queue `job` under `key` (a second submit of the same key is ignored)."""
    global _POOL
    if key in _JOBS:
        return
    if _POOL is None:
        _POOL = ThreadPoolExecutor(1, thread_name_prefix="tests-ahead")
    _JOBS[key] = _POOL.submit(job)


def result(key: Hashable, job: Callable[[], Any]) -> Any:
    """What the job queued under `key` returned (waiting for it), or, when none was queued, `job()` run now."""
    future = _JOBS.pop(key, None)
    return future.result() if future is not None else job()


def stop() -> None:
    """Drop the jobs not started; a running one finishes (its own timeout bounds it) in the background."""
    global _POOL
    _JOBS.clear()
    if _POOL is not None:
        _POOL.shutdown(wait=False, cancel_futures=True)
        _POOL = None
