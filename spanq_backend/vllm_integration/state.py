"""The state spanq keeps beside vLLM's objects: one `Extension` per kind of vLLM object the plugin extends.

Each holds one state object per vLLM object, weakly (it goes when vLLM drops the object, and a new object
never inherits an old one's state). Nothing is stored on vLLM's own objects.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["Extension"]

S = TypeVar("S")


class Extension(Generic[S]):
    """`extension(obj)`: the state of `obj`, made by `make(obj)` on first use; `extension.get(obj)`: or None."""

    def __init__(self, what: str, make: Callable[[Any], S]):
        self.what = what  # for readers and reprs: which vLLM object this extends
        self._make = make
        self._of: weakref.WeakKeyDictionary[Any, S] = weakref.WeakKeyDictionary()

    def __call__(self, obj: Any) -> S:
        state = self._of.get(obj)
        if state is None:
            state = self._of[obj] = self._make(obj)
        return state

    def get(self, obj: Any) -> S | None:
        return self._of.get(obj)

    def set(self, obj: Any, state: S) -> None:
        self._of[obj] = state

    def values(self) -> Iterator[S]:
        return iter(list(self._of.values()))

    def __repr__(self) -> str:
        return f"Extension({self.what!r}, {len(self._of)} live)"
