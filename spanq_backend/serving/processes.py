"""The processes of this machine by parent or by process group, read from /proc (Linux; elsewhere none)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["processes"]


def processes(*, parent: int | None = None, group: int | None = None) -> list[int]:
    """The live (not zombie) processes whose parent is `parent` and/or whose process group is `group`, this
    process left out."""
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
        if fields[0] == "Z":
            continue
        if (parent is None or int(fields[1]) == parent) and (group is None or int(fields[2]) == group):
            found.append(int(entry.name))
    return found
