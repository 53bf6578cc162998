"""Changing a setting of a shared object (the session's engine's generator) for the length of a block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def temporarily(obj: Any, **values: Any) -> Iterator[Any]:
    """Set attributes of `obj` for the block, then put back the values they had (not a default: another module
    may run with its own), also when the block raises."""
    missing = [name for name in values if not hasattr(obj, name)]
    if missing:  # a typo would set a new attribute that nothing reads, and the test would check nothing
        raise AttributeError(f"{type(obj).__name__} has no setting {', '.join(missing)}")
    before = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield obj
    finally:
        for name, value in before.items():
            setattr(obj, name, value)
