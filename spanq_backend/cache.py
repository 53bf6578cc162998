"""Where spanq keeps what it builds once per machine (model folders, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """$SPANQ_CACHE_DIR, else ~/.cache/spanq."""
    configured = os.environ.get("SPANQ_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "spanq"
