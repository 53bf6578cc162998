"""EmbeddedBackend: the span-aware vLLM engine in this process, as a spanq `Backend` (the default backend)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Self

from spanq_backend.serving.engine import EngineConfig, SpanEngine
from spanq_backend.serving.models import (
    DEFAULT_MODEL_NAMES,
    TINY_FAMILY_PREFIX,
    TINY_MODEL_NAMES,
    resolve_model,
)
from spanq_backend.vllm_integration import openmp
from spanq_integrations.backends.protocol import (
    Backend,
    BackendCapabilities,
    Completion,
    TokenCallback,
    server_model_name,
)
from spanq_integrations.query.errors import BackendUnavailableError
from spanq_integrations.query.ir import Generate

__all__ = ["EmbeddedBackend", "shared_embedded_backend"]

log = logging.getLogger("spanq.embedded")


class EmbeddedBackend(Backend):
    """Runs span queries on an in-process `SpanEngine` (started here, or shared with others)."""

    def __init__(self, model: str = "default", *, engine: SpanEngine | None = None, **engine_options: Any):
        self._owns_engine = engine is None
        self._warned: set[str] = set()  # model names a call gave that this engine does not serve (said once)
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

    @property
    def identity(self) -> str:
        """Its engine's settings, every one that may change an answer among them (the model, recompute, anchors)."""
        return f"{type(self).__name__}({self.engine.config!r})"

    async def token_ids(self, text: str, model: str = "") -> list[int] | None:
        """`text` as this engine's tokenizer splits it (no special tokens)."""
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def serves(self, model: str) -> bool:
        """Whether `model` names this engine's model (as given, its folder, its served name, or a spanq name such
        as "default" or "tiny" for the folder it stands for)."""
        e = self.engine
        if (bare := server_model_name(model)) != model and self.serves(bare):  # ("spnl/tiny": spnl's provider)
            return True  # (the name as given is tried too: "openai/gpt-oss-20b" is a Hugging Face id)
        if model in {"", e.config.model, e.model_name, str(e.model_path), e.model_path.name}:
            return True
        if model in DEFAULT_MODEL_NAMES or model in TINY_MODEL_NAMES or model.startswith(TINY_FAMILY_PREFIX):
            try:
                return resolve_model(model) == e.model_path
            except ValueError:
                return False
        return False

    async def generate(
        self,
        call: Generate,
        *,
        path: str = "$",
        on_token: TokenCallback | None = None,
        span_output: bool = False,
    ) -> Completion:
        if call.model not in self._warned and not self.serves(call.model):
            self._warned.add(call.model)
            log.warning(
                "the embedded engine runs %s; a call names model %r, which it does not serve: the call runs on %s "
                "(start an engine on that model with EmbeddedBackend(model=...), ChatSpanQuery(model=...) or "
                "SpanQueryLLM(model=...))", self.model_name, call.model, self.model_name,
            )
        # The calling thread may hold an idle OpenMP team (an embedding model run on it before this call): while it
        # lives, libgomp throttles the engine thread's team and every step takes ~1.5x as long. Hand it back; the
        # thread's next torch operator starts a new one (vllm_integration/openmp.py).
        openmp.release_workers()
        return await self.engine.generate(call, path=path, on_token=on_token, span_output=span_output)

    def pin(self, texts: list[str]) -> dict[str, Any]:
        """Keep these documents' span KV in the engine's KV cache whatever else runs, until `unpin()`: computed now
        where not cached (`SpanEngine.compile(texts, pin=True)`: at most half the cache; its report). The texts as
        the app's queries send them (`corpus_texts` in `spanq_integrations.langchain` and `.llamaindex`). From a
        script or from inside a running event loop."""
        from spanq_integrations.runtime.sync import run_sync

        return run_sync(lambda: self.engine.compile(list(texts), pin=True), name="spanq-pin")

    def unpin(self) -> int:
        """Drop the pins `pin` took (the blocks stay cached, evicted as any other from now on); how many blocks."""
        return self.engine.unpin()

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine this backend started (not one it was given). One left running is stopped at exit."""
        if self._owns_engine:
            self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _SharedEmbeddedBackend(EmbeddedBackend):
    """A process-wide engine: closing it through a query run does nothing; `shutdown()` stops it. An engine that
    failed (its thread stopped on an error) is started again by the next call, with a warning naming the failure:
    every adapter holding this backend would otherwise be refused for the life of the process. A start that fails
    is not tried again for `RESTART_BACKOFF_S` (calls meanwhile get its error at once)."""

    RESTART_BACKOFF_S = 30.0

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self._restart_lock = threading.Lock()  # one start at a time
        self._state_lock = threading.Lock()  # `engine` and `_shut_down`, read and set together
        self._shut_down = False
        self._failed_start: tuple[float, str] | None = None  # when the last start failed, and why

    async def generate(
        self,
        call: Generate,
        *,
        path: str = "$",
        on_token: TokenCallback | None = None,
        span_output: bool = False,
    ) -> Completion:
        if self.engine.closed and not self._shut_down:
            await asyncio.to_thread(self._restart)
        return await super().generate(call, path=path, on_token=on_token, span_output=span_output)

    def _restart(self) -> None:
        with self._restart_lock:
            stopped = self.engine
            if not stopped.closed or self._shut_down:
                return  # started again meanwhile, or shut down (its calls are refused, as a closed engine's)
            failed = self._failed_start
            if failed is not None and time.monotonic() - failed[0] < self.RESTART_BACKOFF_S:
                raise BackendUnavailableError(f"the shared embedded engine could not be started again: {failed[1]}")
            log.warning("the shared embedded engine on %s stopped (%s); starting a new one", self.model_name,
                        stopped.failure or "it was closed")  # fmt: skip
            stopped.join()  # its weights and KV cache let go first: a GPU has room for one engine
            try:
                started = SpanEngine(stopped.config)
            except Exception as e:
                self._failed_start = (time.monotonic(), str(e) or type(e).__name__)
                raise
            self._failed_start = None
            with self._state_lock:
                if not self._shut_down:
                    self.engine, started = started, None
            if started is not None:  # shut down while it started: it must not outlive the shutdown
                started.close()

    async def aclose(self) -> None:
        return None

    def close(self) -> None:
        return None

    def shutdown(self) -> None:
        """Stop the engine; the next caller naming its model starts a new one. A start under way (after a
        failure) is closed as soon as it is done."""
        with _shared_lock:
            for key, backend in list(_shared.items()):
                if backend is self:
                    del _shared[key]
        with self._state_lock:
            self._shut_down = True
            engine = self.engine
        engine.close()


_shared: dict[str, _SharedEmbeddedBackend] = {}
_shared_lock = threading.Lock()


def shared_embedded_backend(model: str | None = None) -> EmbeddedBackend:
    """The embedded backend on `model` (None or "": the default model), started on first use and shared by the
    whole process: one engine per model, whoever asks for it."""
    with _shared_lock:
        for running in _shared.values():  # a running engine named by its served name or folder name
            if model and running.serves(model):
                return running
    key = str(resolve_model(model or "default"))
    with _shared_lock:
        if key not in _shared:
            _shared[key] = _SharedEmbeddedBackend(key)
        return _shared[key]
