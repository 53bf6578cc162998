"""Run one command as the leader of its own process group, and take the whole group down with it.

    SPANQ_SUPERVISE_PARENT=<the starter's pid> python -m spanq_backend.cluster.supervise COMMAND [ARGS...]

A cluster replica starts its `spanq serve` through this: the server's vLLM engine core is a process of its own,
and when the server dies (killed, crashed, or while the engine is still starting) nothing else would stop that
engine, which holds its memory. Here, whichever ends first (the command, a SIGTERM/SIGINT to this process, or
the death of the process that started this one, Linux) ends the group: SIGTERM to every member, SIGKILL to
what is left after a grace period. The exit status is the command's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Any

from spanq_backend.serving.processes import end_all, identities, processes

GRACE_S = 20.0
PARENT_ENV = "SPANQ_SUPERVISE_PARENT"  # the pid of the process that starts this one, set by it


def end_group(grace_s: float = GRACE_S) -> None:
    """SIGTERM to the rest of this process's group, then SIGKILL to what is still there after `grace_s` (members
    that join meanwhile included)."""
    pgid = os.getpgrp()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def members() -> dict[int, int]:
        return identities(processes(group=pgid))

    end_all(members(), grace_s, joining=members)


def _term_with_parent(parent: int | None = None) -> None:  # pragma: no cover - also runs between fork and exec
    """SIGTERM to this process when its parent dies (Linux). With `parent` (the pid it was started by): if that
    parent is already gone, no signal would come, and the process ends here."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if parent is not None and os.getppid() != parent:
            os._exit(128 + signal.SIGTERM)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m spanq_backend.cluster.supervise COMMAND [ARGS...]", file=sys.stderr)
        return 2
    with contextlib.suppress(PermissionError):
        os.setsid()  # a new group, led by this process (already so if the caller made one)
    # SIGTERM here when the process that started this one dies. That process names itself in PARENT_ENV (a replica
    # does): if it died before this line (killed while the interpreter started, ~0.1 s), no signal would ever come,
    # and this process ends here instead of running the command with nothing to end it.
    parent = os.environ.pop(PARENT_ENV, "")
    _term_with_parent(int(parent) if parent.isdigit() else None)

    def on_signal(signum: int, _frame: Any) -> None:
        end_group()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # The command gets SIGTERM if this process is killed outright (Ray kills a dead actor's children so).
    me = os.getpid()
    child = subprocess.Popen(argv, preexec_fn=lambda: _term_with_parent(me))  # noqa: PLW1509
    code = child.wait()
    end_group()
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
