"""Hand a thread's idle OpenMP workers back, so that an engine busy in another thread keeps its own spinning.

PyTorch's CPU wheels run parallel operators on GNU OpenMP (libgomp). Each thread that runs one gets a team of
worker threads of its own, kept for the thread's life. Between two parallel regions libgomp lets a team's workers
spin for the next one, but only while the process's OpenMP workers, all teams together, are no more than its
CPUs: past that it spins ~100 times, then sleeps each worker on a futex, and every parallel region pays a wake-up.
One idle team beside an engine is enough to cross that line on a small machine: an embedded engine's 80-token
answer took x1.50 as long beside a parked thread that had run one matrix product, x0.99 after that thread ended
(`python scripts/idle_cost.py thread`; docs/design.md §8 has the runs). No environment variable moves the line
(`OMP_WAIT_POLICY=ACTIVE` and `GOMP_SPINCOUNT` set the spin of the unthrottled case only).

`release_workers()` ends the calling thread's team (OpenMP 5.0's `omp_pause_resource_all`); the thread's next
parallel region starts a new one, which costs a thread start. The embedded engine calls it each time its thread
goes idle; an application that runs torch on threads of its own (embeddings, a reference model) can call it
there. It does nothing where torch is not on libgomp (Intel OpenMP reads `KMP_BLOCKTIME` instead).

`name_this_thread()` gives the calling thread its name in the operating system too (`top -H`, `/proc`); the
OpenMP workers it starts inherit it, which is how one sees whose team is alive.
"""

from __future__ import annotations

import ctypes
import os
import time

__all__ = ["name_this_thread", "release_workers"]

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: the runtime's threads and their state are freed


# path -> each libgomp found so far (torch, scikit-learn and sentencepiece each ship their own copy, each with its
# own count of workers)
_found: dict[str, ctypes.CDLL] = {}
_looked_at = [float("-inf")]  # when the process's mappings were last read for them
RESCAN_S = 30.0  # reading the mappings costs milliseconds: a library loaded since is found within this


def _libgomps() -> list[ctypes.CDLL]:
    """Every libgomp this process has loaded, each with OpenMP 5.0's pause (looked for again after `RESCAN_S`:
    a library loaded later is found then)."""
    if time.monotonic() - _looked_at[0] < RESCAN_S:
        return list(_found.values())
    _looked_at[0] = time.monotonic()
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return list(_found.values())
    for path in sorted(paths - _found.keys()):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            pause = lib.omp_pause_resource_all
        except (OSError, AttributeError):  # not loaded after all, or a libgomp older than OpenMP 5.0
            continue
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        _found[path] = lib
    return list(_found.values())


def release_workers() -> bool:
    """End the calling thread's OpenMP worker teams, one per libgomp loaded (call it outside any parallel region,
    e.g. before the thread waits for work). True when a libgomp was found and each did so."""
    libs = _libgomps()
    return bool(libs) and all(lib.omp_pause_resource_all(OMP_PAUSE_HARD) == 0 for lib in libs)


PR_SET_NAME = 15  # prctl(2)


def name_this_thread(name: str) -> None:
    """Name the calling thread for the operating system (Linux keeps the first 15 bytes); elsewhere, nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
