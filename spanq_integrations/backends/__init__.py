"""Serving backends: any OpenAI-compatible server, a running `spanq serve`, or the embedded span-aware engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spanq_integrations.backends.protocol import (
    Backend,
    BackendCapabilities,
    CallMetrics,
    Completion,
    TokenCallback,
)
from spanq_integrations.backends.resolve import default_backend, embedded, resolve_backend

if TYPE_CHECKING:
    from spanq_integrations.backends.openai import OpenAIBackend
    from spanq_integrations.backends.span import SpanBackend

__all__ = [
    "Backend",
    "BackendCapabilities",
    "CallMetrics",
    "Completion",
    "EmbeddedBackend",
    "OpenAIBackend",
    "SpanBackend",
    "TokenCallback",
    "default_backend",
    "resolve_backend",
]


def __getattr__(name: str) -> Any:
    if name == "OpenAIBackend":
        from spanq_integrations.backends.openai import OpenAIBackend

        return OpenAIBackend
    if name == "SpanBackend":
        from spanq_integrations.backends.span import SpanBackend

        return SpanBackend
    if name == "EmbeddedBackend":
        return embedded("EmbeddedBackend")
    raise AttributeError(name)
