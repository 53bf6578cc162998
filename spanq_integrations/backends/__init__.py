"""Serving backends: any OpenAI-compatible server, a running `spanq serve`, or the embedded span-aware engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Backend, BackendCapabilities, CallMetrics, Completion, TokenCallback

if TYPE_CHECKING:
    from .openai import OpenAIBackend
    from .span import SpanBackend

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
        from .openai import OpenAIBackend

        return OpenAIBackend
    if name == "SpanBackend":
        from .span import SpanBackend

        return SpanBackend
    if name == "EmbeddedBackend":
        # The one lazy import from the client side into the server side (DESIGN.md).
        from spanq_backend.embedded import EmbeddedBackend

        return EmbeddedBackend
    raise AttributeError(name)


def default_backend() -> Backend:
    """The process-wide embedded span-aware backend on the default model (started on first use)."""
    from spanq_backend.embedded import shared_embedded_backend

    return shared_embedded_backend()


def resolve_backend(spec: str | None) -> tuple[Backend, bool]:
    """A backend for `spec`, and whether the caller owns it (must close it).

    `None` or `"embedded"`: the shared embedded default (not owned). `"spanq+http://host:port"`: a `spanq serve`
    server. Any other `http(s)://` URL: an OpenAI-compatible server.
    """
    if spec is None or spec == "embedded":
        return default_backend(), False
    if spec.startswith(("spanq+http://", "spanq+https://")):
        from .span import SpanBackend

        return SpanBackend(spec.removeprefix("spanq+")), True
    if spec.startswith(("http://", "https://")):
        from .openai import OpenAIBackend

        return OpenAIBackend(spec), True
    from ..errors import SpanQueryError

    raise SpanQueryError(
        f"unknown backend {spec!r}: use an http(s):// URL of an OpenAI-compatible server, "
        "spanq+http://host:port for a `spanq serve` server, or 'embedded'"
    )
