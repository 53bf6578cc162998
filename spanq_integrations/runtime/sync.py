"""The one bridge from synchronous code to spanq's async runtime (`execute`, `judge`).

From a plain thread, a coroutine runs on a fresh event loop (`asyncio.run`). From inside a running loop (a
notebook cell), it runs on a fresh loop in a helper thread, so the caller's loop is never re-entered. (The
framework adapters keep one long-lived loop instead: `background_loop`.)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["run_sync"]

T = TypeVar("T")


def run_sync(make: Callable[[], Coroutine[Any, Any, T]], name: str = "spanq-sync") -> T:
    """Run the coroutine `make()` to its end and return its result (or raise its error)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(make())
        except BaseException as e:  # noqa: BLE001  (handed back to the caller below)
            box["error"] = e

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
