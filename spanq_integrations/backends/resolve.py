"""The one place a backend is chosen from what a user wrote: None, "embedded", or a URL.

Every entry point (`execute`, `judge`, `spanq run`, the LangChain and LlamaIndex adapters) resolves its backend
here, so what a URL means, which environment variables apply and how a bad spec is reported are the same
everywhere.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from spanq_integrations.backends._http import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_S
from spanq_integrations.backends.protocol import Backend, server_model_name
from spanq_integrations.query.errors import SpanQueryError

__all__ = [
    "API_KEY_ENV",
    "BACKEND_ENV",
    "BACKEND_URL_SCHEMES",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT_S",
    "EMBEDDED",
    "check_backend_spec",
    "default_backend",
    "embedded_model_named",
    "env_backend",
    "resolve_backend",
    "runs_embedded",
]

# The embedded span-aware engine lives in the server package; the client side reaches it by name only (the
# package stays importable without torch or vLLM, and the layers stay one-way).
EMBEDDED = "spanq_backend.serving.embedded"

API_KEY_ENV = "SPANQ_API_KEY"  # the bearer token sent to URL backends when the caller passes none
BACKEND_ENV = "SPANQ_BACKEND"  # the backend of callers that name none (None): a URL or "embedded"
SPAN_SCHEMES = ("spanq+http://", "spanq+https://")
BACKEND_URL_SCHEMES = ("http://", "https://", *SPAN_SCHEMES)



def embedded(attr: str) -> Any:
    """An attribute of the embedded backend's module, imported on first use."""
    return getattr(importlib.import_module(EMBEDDED), attr)


def env_backend() -> str | None:
    """`$SPANQ_BACKEND` (a URL or "embedded"): where a caller that names no backend runs; None when unset."""
    return os.environ.get(BACKEND_ENV) or None


def default_backend(model: str | None = None) -> Backend:
    """The process-wide embedded span-aware backend on `model` (None: the default model; "tiny", "tiny-qwen3", a
    model folder or a Hugging Face id otherwise), started on first use and shared by every caller naming it."""
    return embedded("shared_embedded_backend")(model)


def runs_embedded(spec: Backend | str | None) -> bool:
    """Whether `spec` (read as `resolve_backend` reads it, $SPANQ_BACKEND for None) is the embedded engine, to be
    started here: not a `Backend` given, nor a server's URL."""
    return not isinstance(spec, Backend) and (spec if spec is not None else env_backend()) in (None, "embedded")


def embedded_model_named(spec: Backend | str | None, model: str | None) -> str | None:
    """`model`, where `spec` (read as `resolve_backend` reads it) is the embedded engine and `model` names one it
    can start with nothing looked up: spanq's names ("default", "tiny", "tiny-<family>") or a model folder. None
    otherwise: such a call runs on the default engine (which warns that it does not serve the name). `execute`
    and `judge` pass what their calls name, so that `model="tiny"` runs on tiny as the adapters' `model=` does."""
    if not model or not runs_embedded(spec):
        return None
    # as given, then after a provider of spnl's ("spnl/tiny"; a folder "openai/x" is tried as given first)
    for name in dict.fromkeys((model, server_model_name(model))):
        if not (name in embedded("DEFAULT_MODEL_NAMES") or name in embedded("TINY_MODEL_NAMES")
                or name.startswith(embedded("TINY_FAMILY_PREFIX")) or os.path.isdir(os.path.expanduser(name))):
            continue  # (a Hugging Face id is never fetched for a call's name)
        try:
            embedded("resolve_model")(name)
        except ValueError:  # not a model after all: the default engine, as before
            continue
        return name
    return None


def unknown_backend(spec: Any) -> str:
    return (
        f"unknown backend {spec!r}: use an http(s):// URL of an OpenAI-compatible server, "
        "spanq+http://host:port for a `spanq serve` server, 'embedded' (or None), or a spanq Backend"
    )


def check_backend_spec(spec: Any) -> Any:
    """`spec` if it names a backend (None, "embedded", a URL, a `Backend`); a `SpanQueryError` saying what is
    accepted otherwise. Checked without opening anything (adapters check at construction)."""
    if spec is None or isinstance(spec, Backend):
        return spec
    if isinstance(spec, str) and (spec == "embedded" or spec.lower().startswith(BACKEND_URL_SCHEMES)):
        return spec  # (schemes are case-insensitive: "HTTP://host" was "an unknown backend")
    raise SpanQueryError(unknown_backend(spec))


def resolve_backend(
    spec: Backend | str | None,
    model: str | None = None,
    *,
    timeout: float | None = None,
    max_retries: int | None = None,
    api_key: str | None = None,
) -> tuple[Backend, bool]:
    """A backend for `spec`, and whether the caller owns it (must close it).

    A `Backend`: itself (not owned). `None`: `$SPANQ_BACKEND` where it is set, else as `"embedded"`. `"embedded"`:
    the shared embedded engine on `model` (the default model when None; not owned). `"spanq+http://host:port"`: a `spanq serve` server; any other `http(s)://` URL:
    an OpenAI-compatible server — both owned, with `model` as the model of calls that name none, `timeout`
    seconds for a whole call, streamed answer included (default 600), `max_retries` retries of a connection that
    failed or an answer of 429/503 "later" (default 2; after its Retry-After, at most 30 s) and
    `api_key` as the bearer token (default: `$SPANQ_API_KEY`, if set).
    """
    if spec is None and (from_env := env_backend()) is not None:
        try:
            check_backend_spec(from_env)
        except SpanQueryError as e:
            raise SpanQueryError(f"${BACKEND_ENV}: {e}") from None
        spec = from_env
    check_backend_spec(spec)
    if isinstance(spec, Backend):
        return spec, False
    if spec is None or spec == "embedded":
        return default_backend(model or None), False
    options: dict[str, Any] = {
        "model": model or None,
        "timeout": DEFAULT_TIMEOUT_S if timeout is None else timeout,
        "max_retries": DEFAULT_MAX_RETRIES if max_retries is None else max_retries,
        "api_key": api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None),
    }
    if spec.lower().startswith(SPAN_SCHEMES):
        from spanq_integrations.backends.span import SpanBackend

        return SpanBackend(spec[len("spanq+") :], **options), True
    from spanq_integrations.backends.openai import OpenAIBackend

    return OpenAIBackend(spec, **options), True
