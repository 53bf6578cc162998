"""`Patch`: one change spanq makes to vLLM, declared once with where it runs and why. The registry of every
patch is `spanq_backend.vllm_integration.PATCHES`; nothing else in the package assigns to a vLLM attribute
(tests/backend/test_vllm_symbols.py checks that)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Patch"]


@dataclass(frozen=True)
class Patch:
    """One change to vLLM: `module.attr` becomes `wrap(stock)` (or `add` where vLLM has nothing to wrap).

    A patch is applied at registration (engine core and worker patches, for the life of the process) or, when
    `scoped`, only inside `with patch.applied(wrap):` (front-end patches that hold while they are needed; the
    wrap is given there, since it closes over what that use needs)."""

    process: str  # where it matters: "engine core", "worker" or "front end"
    module: str
    attr: str  # "name" or "Class.name"
    why: str
    wrap: Callable[[Any], Any] | None = None
    add: Any = None  # a new attribute (a method vLLM does not have)
    scoped: bool = False

    def _owner(self) -> tuple[Any, str]:
        owner: Any = importlib.import_module(self.module)
        *path, name = self.attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, name

    def apply(self) -> None:
        """Apply for the life of the process (registration)."""
        if self.scoped:
            raise RuntimeError(f"{self.module}.{self.attr} is a scoped patch: use `with patch.applied(wrap)`")
        owner, name = self._owner()
        if self.wrap is None:
            setattr(owner, name, self.add)
            return
        setattr(owner, name, _wrapped(self.wrap, getattr(owner, name), name))

    @contextlib.contextmanager
    def applied(self, wrap: Callable[[Any], Any]) -> Iterator[None]:
        """While inside, `module.attr` is `wrap(stock)`; the stock one is back on leaving, however it is left."""
        owner, name = self._owner()
        stock = getattr(owner, name)
        setattr(owner, name, _wrapped(wrap, stock, name))
        try:
            yield
        finally:
            setattr(owner, name, stock)


def _wrapped(wrap: Callable[[Any], Any], stock: Any, name: str) -> Any:
    patched = wrap(stock)
    patched.__wrapped__ = stock
    patched.__name__ = getattr(stock, "__name__", name)
    patched.__qualname__ = getattr(stock, "__qualname__", name)
    return patched
