"""Recover the documents a LangChain run retrieved, so an unchanged RAG chain can send them as spans.

In `{"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm` the model only
sees the finished prompt; the documents went by in sibling runs. `RunDocumentTracker` is a callback handler
that LangChain adds to every run of the process (a configure hook, installed when `spanq_integrations.langchain`
is imported): it remembers, per root run, the documents that retrievers and tools returned, the documents any
step returned (a list of `Document`s, or a dict holding one, e.g. a LangGraph node's update), and the span blocks
`format_docs_as_spans` produced. When a spanq model runs inside that root run it asks for them and looks for
them in its prompt (`messages.split_at_documents`). What a root run collected is forgotten when it ends; at
most `MAX_ROOTS` root runs are kept (the oldest go first).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document

from spanq_integrations.langchain.messages import SpanCandidate
from spanq_integrations.langchain.spans import (
    SpanDocuments,
    document_span_id,
    is_tagged_document,
    span_marker,
)

__all__ = ["MAX_ROOTS", "RunDocumentTracker", "install_tracker", "run_document_tracker"]

MAX_ROOTS = 256
SPANQ_MODEL_TYPES = ("spanq-chat", "spanq")  # the `_llm_type`s of ChatSpanQuery and SpanQueryLLM

# The run of the spanq model call that started last in this context. LangChain's `BaseChatModel.stream` calls
# `_stream` without its run manager; the model finds its own run here instead.
_current_model_run: ContextVar[UUID | None] = ContextVar("spanq_current_model_run", default=None)


def _documents_in(value: Any) -> list[Document]:
    if isinstance(value, Document):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(d, Document) for d in value):
        return list(value)
    return []


class _Root:
    __slots__ = ("documents", "formatted", "runs")

    def __init__(self) -> None:
        self.runs: set[UUID] = set()
        self.documents: list[Document] = []
        self.formatted: list[SpanCandidate] = []


class RunDocumentTracker(BaseCallbackHandler):
    """Remembers, per root run, the documents retrieved or produced inside it (thread-safe, runs inline)."""

    run_inline = True
    raise_error = False

    def __init__(self, max_roots: int = MAX_ROOTS) -> None:
        self.max_roots = max_roots
        self._lock = threading.Lock()
        self._root_of: dict[UUID, UUID] = {}
        self._roots: OrderedDict[UUID, _Root] = OrderedDict()

    # ----------------------------------------------------------------------------------------- bookkeeping

    def _start(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        with self._lock:
            root_id = self._root_of.get(parent_run_id, parent_run_id) if parent_run_id else run_id
            root = self._roots.get(root_id)
            if root is None:
                root = self._roots[root_id] = _Root()
                root.runs.add(root_id)
                self._root_of[root_id] = root_id
                while len(self._roots) > self.max_roots:
                    _, evicted = self._roots.popitem(last=False)
                    for r in evicted.runs:
                        self._root_of.pop(r, None)
            root.runs.add(run_id)
            self._root_of[run_id] = root_id

    def _root(self, run_id: UUID) -> _Root | None:
        root_id = self._root_of.get(run_id)
        return None if root_id is None else self._roots.get(root_id)

    def _collect(self, run_id: UUID, value: Any) -> None:
        docs = _documents_in(value)
        formatted: list[SpanCandidate] = []
        if isinstance(value, SpanDocuments):
            formatted = [SpanCandidate(b["text"], (span_marker(b) or {}).get("id")) for b in value]
        elif isinstance(value, dict):
            for v in value.values():
                docs.extend(_documents_in(v))
                if isinstance(v, SpanDocuments):
                    formatted.extend(SpanCandidate(b["text"], (span_marker(b) or {}).get("id")) for b in v)
        if not docs and not formatted:
            return
        with self._lock:
            root = self._root(run_id)
            if root is not None:
                root.documents.extend(docs)
                root.formatted.extend(formatted)

    def _end(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        if parent_run_id is not None:
            return
        with self._lock:
            root = self._roots.pop(run_id, None)
            if root is not None:
                for r in root.runs:
                    self._root_of.pop(r, None)

    def candidates(self, run_id: UUID, *, tagged_only: bool = False) -> list[SpanCandidate]:
        """The texts to look for in the prompt of run `run_id`: formatted span blocks first, then documents."""
        with self._lock:
            root = self._root(run_id)
            if root is None:
                return []
            formatted = list(root.formatted)
            documents = list(root.documents)
        if tagged_only:
            documents = [d for d in documents if is_tagged_document(d)]
            formatted = [c for c in formatted if c.id is not None]
        return formatted + [SpanCandidate(d.page_content, document_span_id(d)) for d in documents]

    @staticmethod
    def current_model_run() -> UUID | None:
        """The run id of the spanq model call that started last in this context (None if none did)."""
        return _current_model_run.get()

    @property
    def tracked_roots(self) -> int:
        """How many root runs are remembered now (each is forgotten when it ends)."""
        return len(self._roots)

    # ----------------------------------------------------------------------------------------- callbacks

    def on_chain_start(self, serialized, inputs, *, run_id, parent_run_id=None, **kwargs: Any) -> None:
        self._start(run_id, parent_run_id)

    def _model_start(self, run_id: UUID, parent_run_id: UUID | None, kwargs: dict[str, Any]) -> None:
        self._start(run_id, parent_run_id)
        params = kwargs.get("invocation_params") or {}
        if params.get("_type") in SPANQ_MODEL_TYPES:
            _current_model_run.set(run_id)

    def on_chat_model_start(self, serialized, messages, *, run_id, parent_run_id=None, **kwargs: Any) -> None:
        self._model_start(run_id, parent_run_id, kwargs)

    def on_llm_start(self, serialized, prompts, *, run_id, parent_run_id=None, **kwargs: Any) -> None:
        self._model_start(run_id, parent_run_id, kwargs)

    def on_retriever_start(self, serialized, query, *, run_id, parent_run_id=None, **kwargs: Any) -> None:
        self._start(run_id, parent_run_id)

    def on_tool_start(self, serialized, input_str, *, run_id, parent_run_id=None, **kwargs: Any) -> None:
        self._start(run_id, parent_run_id)

    def on_retriever_end(self, documents, *, run_id, parent_run_id=None, **kwargs: Any) -> None:
        self._collect(run_id, list(documents))
        self._end(run_id, parent_run_id)

    def on_chain_end(self, outputs, *, run_id, parent_run_id=None, **kwargs: Any) -> None:
        self._collect(run_id, outputs)
        self._end(run_id, parent_run_id)

    def on_llm_end(self, response, *, run_id, parent_run_id=None, **kwargs: Any) -> None:
        self._end(run_id, parent_run_id)

    def on_tool_end(self, output, *, run_id, parent_run_id=None, **kwargs: Any) -> None:
        # A tool that returns documents (an agent's search), as its output or as a ToolMessage's artifact.
        self._collect(run_id, output)
        artifact = getattr(output, "artifact", None)
        if artifact is not None:
            self._collect(run_id, artifact)
        self._end(run_id, parent_run_id)

    def on_chain_error(self, error, *, run_id, parent_run_id=None, **kwargs: Any) -> None:
        self._end(run_id, parent_run_id)

    def on_llm_error(self, error, *, run_id, parent_run_id=None, **kwargs: Any) -> None:
        self._end(run_id, parent_run_id)

    def on_retriever_error(self, error, *, run_id, parent_run_id=None, **kwargs: Any) -> None:
        self._end(run_id, parent_run_id)

    def on_tool_error(self, error, *, run_id, parent_run_id=None, **kwargs: Any) -> None:
        self._end(run_id, parent_run_id)


_tracker = RunDocumentTracker()
# Its default is the tracker, so every thread and task sees it; `.set(None)` turns it off in one context.
_tracker_var: ContextVar[RunDocumentTracker | None] = ContextVar(
    "spanq_run_document_tracker", default=_tracker
)
_installed = False
_install_lock = threading.Lock()


def install_tracker() -> RunDocumentTracker:
    """Add the tracker to every LangChain run of this process (idempotent) and return it."""
    global _installed
    with _install_lock:
        if not _installed:
            from langchain_core.tracers.context import register_configure_hook

            _installed = True
            register_configure_hook(_tracker_var, inheritable=True)
    return _tracker


def run_document_tracker() -> RunDocumentTracker:
    return _tracker
