"""The backend protocol: what the executor needs from a serving backend, and the metrics every call reports."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field

from ..ir import Generate

__all__ = ["Backend", "BackendCapabilities", "CallMetrics", "Completion", "TokenCallback"]

TokenCallback = Callable[[str], Awaitable[None] | None]


class BackendCapabilities(BaseModel):
    """What a backend can do; the optimizer plans differently for span-aware backends."""

    model_config = ConfigDict(frozen=True)

    name: str
    span_aware: bool = False
    prepares_spans: bool = False  # the backend puts each span in the cache itself, under the right anchor
    max_concurrency: int = 8


class CallMetrics(BaseModel):
    """One model call, as measured by the client: times in seconds, token counts as the server reported them."""

    path: str = "$"
    model: str = ""
    ttft_s: float | None = None
    wall_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    padded_tokens: int = 0
    prepared_spans: int = 0
    fallback: str | None = None  # why the call's spans were sent as ordinary prompt text, when they were
    extra: dict[str, Any] = Field(default_factory=dict)


class Completion(BaseModel):
    """The answer to one `Generate`: `n` choices and the call's metrics."""

    texts: list[str]
    finish_reasons: list[str | None] = Field(default_factory=list)
    metrics: CallMetrics

    @property
    def text(self) -> str:
        return self.texts[0]


class Backend(abc.ABC):
    """A serving backend. `generate` receives a `Generate` whose input is closed (no pending inner calls)."""

    capabilities: BackendCapabilities

    @abc.abstractmethod
    async def generate(
        self, call: Generate, *, path: str = "$", on_token: TokenCallback | None = None
    ) -> Completion:
        """Run one model call; stream text pieces of the first choice to `on_token` as they arrive."""

    async def aclose(self) -> None:
        """Release connections and engines; the backend is unusable afterwards."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
