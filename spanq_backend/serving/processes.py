"""The processes of this machine by parent or by process group, read from /proc (Linux; elsewhere none), and
`ExitGuard`: a SIGTERM ends a process and what it started within a bound."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ExitGuard", "adopt_orphans", "descendants", "end_all", "identities", "processes", "reap_adopted"]


def _table() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent, group) of every process but this one."""
    found = []
    me = os.getpid()
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        found.append((int(entry.name), fields[0], int(fields[1]), int(fields[2])))
    return found


def processes(*, parent: int | None = None, group: int | None = None) -> list[int]:
    """The live (not zombie) processes whose parent is `parent` and/or whose process group is `group`, this
    process left out."""
    return [
        pid
        for pid, state, ppid, pgrp in _table()
        if state != "Z" and (parent is None or ppid == parent) and (group is None or pgrp == group)
    ]


def descendants(pid: int) -> list[int]:
    """The live processes `pid` started, and theirs, and so on (parents before their children)."""
    children: dict[int, list[int]] = {}
    for child, state, ppid, _ in _table():
        if state != "Z":
            children.setdefault(ppid, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def _started(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def identities(pids: list[int]) -> dict[int, int]:
    """`{pid: start time}` of the live ones among `pids`: what `end_all` needs to tell them from a process that
    later gets a reused pid."""
    return {pid: started for pid in pids if (started := _started(pid)) is not None}


def end_all(started: dict[int, int], grace_s: float, *, joining: Callable[[], dict[int, int]] | None = None) -> list[int]:
    """End the processes of `identities(...)` that are still there: SIGTERM, then SIGKILL to what is left after
    `grace_s`. `joining`, where given, names more (`identities` too) before each signal: processes started since
    (a process group's new members). Returns the pids that had to be killed."""
    started = dict(started)

    def left() -> list[int]:
        return [pid for pid, when in started.items() if _started(pid) == when]

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if joining is not None:
            started.update(joining())
        if not (pids := left()):
            return []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while left() and time.monotonic() < deadline:  # (a zombie is gone: whose it is to reap, it decides)
            time.sleep(0.1)
        if sig == signal.SIGKILL:
            return pids
    return []


def adopt_orphans() -> bool:
    """Make this process the one that inherits its descendants' orphans (Linux's child subreaper), so that what it
    started stays among its `descendants` when a process between them dies. The orphans' exits are then this
    process's to reap (`reap_adopted`). False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap_adopted(own: set[int]) -> None:
    """Reap the exited orphans this process adopted: its zombie children, less `own` (the children it started
    itself, whose exits their own `Popen` objects collect)."""
    me = os.getpid()
    for pid, state, ppid, _ in _table():
        if state == "Z" and ppid == me and pid not in own:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


class ExitGuard:
    """A SIGTERM ends this process and everything it started (`spanq serve`: its engine core and that one's
    workers) within a bound, whatever state a shutdown is in.

    Until a graceful handler is taken over (`follow_graceful`), at once: what this process started is killed and
    it exits. After, the graceful handler runs, and if this process is still there `deadline_s` after the
    SIGTERM, it is ended the same way. Linux only (elsewhere `install` does nothing)."""

    def __init__(self, deadline_s: float = 30.0):
        self.deadline_s = deadline_s
        self.graceful: Any = None  # the handler that stops this process gracefully, once taken over
        self.armed = False

    def install(self) -> None:
        if Path("/proc/self/stat").exists():
            signal.signal(signal.SIGTERM, self.on_term)

    def on_term(self, signum: int, frame: Any) -> None:
        if self.graceful is None:
            self.end(signum)
        if not self.armed:
            self.armed = True
            threading.Thread(target=self._deadline, args=(signum,), name="exit-deadline", daemon=True).start()
        if callable(self.graceful):
            self.graceful(signum, frame)

    def _deadline(self, signum: int) -> None:
        time.sleep(self.deadline_s)
        print(f"not shut down {self.deadline_s:.0f} s after SIGTERM: killing what this process started, and exiting",
              file=sys.stderr, flush=True)  # fmt: skip
        self.end(signum)

    @staticmethod
    def end(signum: int) -> None:
        """Kill everything this process started, then exit at once. (Not multiprocessing's resource tracker: it
        exits once the processes using it are gone, after it has unlinked the shared memory they left.)"""
        for pid in descendants(os.getpid()):
            try:
                if b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone already
                continue
        os._exit(128 + signum)

    async def follow_graceful(self, period_s: float = 0.2) -> None:
        """On an event loop: once another SIGTERM handler replaces this one (an HTTP server's graceful one, set
        with `loop.add_signal_handler`), put this one back in front of it. (The loop still learns of the signal:
        Python writes it to the loop's wakeup fd, whichever handler is set.)"""
        while (handler := signal.getsignal(signal.SIGTERM)) == self.on_term:
            await asyncio.sleep(period_s)
        if callable(handler):
            self.graceful = handler
            signal.signal(signal.SIGTERM, self.on_term)
