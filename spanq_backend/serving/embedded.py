"""EmbeddedBackend: the span-aware vLLM engine in this process, as a spanq `Backend` (the default backend)."""

from __future__ import annotations

import threading
from typing import Any

from spanq_backend.serving.engine import EngineConfig, SpanEngine
from spanq_integrations.backends.protocol import Backend, BackendCapabilities, Completion, TokenCallback
from spanq_integrations.query.ir import Generate

__all__ = ["EmbeddedBackend", "shared_embedded_backend"]


class EmbeddedBackend(Backend):
    """Runs span queries on an in-process `SpanEngine` (started here, or shared with others)."""

    def __init__(self, model: str = "default", *, engine: SpanEngine | None = None, **engine_options: Any):
        self._owns_engine = engine is None
        self.engine = engine or SpanEngine(EngineConfig(model=model, **engine_options))
        spans = self.engine.config.spans
        self.capabilities = BackendCapabilities(
            name="embedded" if spans else "embedded-stock",
            span_aware=spans,
            prepares_spans=spans,
            span_outputs=spans,
            max_concurrency=self.engine.config.max_num_seqs,
        )

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    async def generate(
        self,
        call: Generate,
        *,
        path: str = "$",
        on_token: TokenCallback | None = None,
        span_output: bool = False,
    ) -> Completion:
        return await self.engine.generate(call, path=path, on_token=on_token, span_output=span_output)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_engine:
            self.engine.close()


class _SharedEmbeddedBackend(EmbeddedBackend):
    """The process-wide default: closing it through a query run does nothing; `shutdown()` stops it."""

    async def aclose(self) -> None:
        return None

    def close(self) -> None:
        return None

    def shutdown(self) -> None:
        self.engine.close()


_shared: _SharedEmbeddedBackend | None = None
_shared_lock = threading.Lock()


def shared_embedded_backend() -> EmbeddedBackend:
    """The embedded backend on the default model, started on first use and shared by the whole process."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = _SharedEmbeddedBackend("default")
        return _shared
