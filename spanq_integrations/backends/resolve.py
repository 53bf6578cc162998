"""The one place a backend is chosen from what a user wrote: None, "embedded", or a URL."""

from __future__ import annotations

import importlib
from typing import Any

from spanq_integrations.backends.protocol import Backend
from spanq_integrations.query.errors import SpanQueryError

__all__ = ["EMBEDDED", "default_backend", "resolve_backend"]

# The embedded span-aware engine lives in the server package; the client side reaches it by name only (the
# package stays importable without torch or vLLM, and the layers stay one-way).
EMBEDDED = "spanq_backend.serving.embedded"


def embedded(attr: str) -> Any:
    """An attribute of the embedded backend's module, imported on first use."""
    return getattr(importlib.import_module(EMBEDDED), attr)


def default_backend(model: str | None = None) -> Backend:
    """The process-wide embedded span-aware backend on `model` (None: the default model; "tiny", "tiny-qwen3", a
    model folder or a Hugging Face id otherwise), started on first use and shared by every caller naming it."""
    return embedded("shared_embedded_backend")(model)


def resolve_backend(spec: Backend | str | None, model: str | None = None) -> tuple[Backend, bool]:
    """A backend for `spec`, and whether the caller owns it (must close it).

    A `Backend`: itself (not owned). `None` or `"embedded"`: the shared embedded engine on `model` (the default
    model when None; not owned).
    `"spanq+http://host:port"`: a `spanq serve` server. Any other `http(s)://` URL: an OpenAI-compatible server.
    """
    if isinstance(spec, Backend):
        return spec, False
    if spec is None or spec == "embedded":
        return default_backend(model), False
    if isinstance(spec, str) and spec.startswith(("spanq+http://", "spanq+https://")):
        from spanq_integrations.backends.span import SpanBackend

        return SpanBackend(spec.removeprefix("spanq+")), True
    if isinstance(spec, str) and spec.startswith(("http://", "https://")):
        from spanq_integrations.backends.openai import OpenAIBackend

        return OpenAIBackend(spec), True
    raise SpanQueryError(
        f"unknown backend {spec!r}: use an http(s):// URL of an OpenAI-compatible server, "
        "spanq+http://host:port for a `spanq serve` server, or 'embedded'"
    )
