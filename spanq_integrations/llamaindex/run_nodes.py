"""The nodes the current LlamaIndex query retrieved, followed through LlamaIndex's instrumentation events: how
`SpanQueryLLM` sends them as spans when it is the only thing swapped in a query engine.

A handler on the root dispatcher opens a record at each `QueryStartEvent`, adds the nodes of each
`RetrievalEndEvent` to it, and at `QueryEndEvent` writes what the query's `SpanQueryLLM` calls did into
`response.metadata["spanq"]` (unless a spanq synthesizer wrote it already). Records live in a context variable:
each query (thread, or asyncio task) sees its own, and a query run inside another (a sub-question engine) gets
its own record on top of its parent's.

A retrieval outside any query (a chat engine's — `ContextChatEngine`, `CondensePlusContextChatEngine` — an agent
tool's, or a retriever called by hand) opens a record of its own that stands until the next such retrieval in the
same context: the LLM calls that follow it (the chat engine's answer) look for its nodes in their prompts. Where the
retrieval runs inside an instrumented call (a chat turn, an agent's run), the record also belongs to the outermost
such call still open (`_SpanTree`, from the dispatcher's spans) and lasts as long as it: an agent workflow runs its
tool and its LLM in different tasks, which share no context variable set in one of them, but share that span; the
nodes of every retrieval in it are looked for.
"""

from __future__ import annotations

import contextvars
import threading
from dataclasses import dataclass, field
from typing import Any

from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.query import QueryEndEvent, QueryStartEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.instrumentation.span import active_span_id
from llama_index.core.instrumentation.span_handlers import BaseSpanHandler
from llama_index.core.schema import MetadataMode

from spanq_integrations.runtime.prompt_spans import SpanCandidate

__all__ = ["QueryRecord", "current_record", "install_tracker"]


@dataclass
class QueryRecord:
    """One query: the nodes it retrieved, and the spanq calls made for it."""

    candidates: list[SpanCandidate] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    keep_calls: int | None = None  # a retrieval outside a query: only its last calls (nothing reads them all)
    span_id: str | None = None  # a query's: the dispatcher span of its `query` call (a query that fails ends there)

    def note_call(self, call: dict[str, Any]) -> None:
        self.calls.append(call)
        if self.keep_calls is not None and len(self.calls) > self.keep_calls:
            del self.calls[: -self.keep_calls]

    def add_nodes(self, nodes: list[Any]) -> None:
        for scored in nodes:
            node = getattr(scored, "node", scored)
            # What LlamaIndex's synthesizers put in the prompt (text with the metadata the LLM sees), and the
            # bare text (templates that leave the metadata out); the longer is looked for first.
            for mode in (MetadataMode.LLM, MetadataMode.NONE):
                self.candidates.append(SpanCandidate(node.get_content(metadata_mode=mode), node.node_id))

    def summary(self) -> dict[str, Any]:
        totals = {k: sum(int(c.get(k) or 0) for c in self.calls)
                  for k in ("spans", "prepared_spans", "deferred_spans", "cached_tokens", "prompt_tokens",
                            "generated_tokens")}
        fallbacks = [c["fallback"] for c in self.calls if c.get("fallback")]
        # (the shape of `usage.usage_of`, the synthesizers': `calls` a count, `per_call` each call's metrics)
        return {**totals, "calls": len(self.calls), "fallback": fallbacks[0] if fallbacks else None,
                "per_call": self.calls}


LOOSE_CALLS_KEPT = 64  # calls remembered after a retrieval outside a query (an app may call its LLM for hours)

_records: contextvars.ContextVar[tuple[QueryRecord, ...]] = contextvars.ContextVar("spanq_query_records", default=())
# The latest retrieval outside any query in this context (a chat engine's turn), until the next one.
_latest: contextvars.ContextVar[QueryRecord | None] = contextvars.ContextVar("spanq_latest_retrieval", default=None)


MAX_OPEN_SPANS = 10_000  # spans followed at once (one never closed, e.g. an abandoned stream, is dropped at last)


class _SpanTree(BaseSpanHandler):
    """The dispatcher's open spans and their parents, and the retrievals made outside a query under each outermost
    open span (its scope: a chat turn, an agent's run). A scope's record goes when its span closes."""

    _parents: dict[str, str | None] = PrivateAttr(default_factory=dict)
    _scoped: dict[str, QueryRecord] = PrivateAttr(default_factory=dict)
    _tree_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @classmethod
    def class_name(cls) -> str:
        return "SpanqSpanTree"

    def span_enter(self, id_: str, bound_args: Any, instance: Any = None, parent_id: str | None = None,
                   tags: Any = None, **kwargs: Any) -> None:  # fmt: skip
        with self._tree_lock:
            self._parents[id_] = parent_id
            while len(self._parents) > MAX_OPEN_SPANS:
                self._close(next(iter(self._parents)))

    def span_exit(self, id_: str, bound_args: Any, instance: Any = None, result: Any = None, **kwargs: Any) -> None:
        with self._tree_lock:
            self._close(id_)

    def span_drop(self, id_: str, bound_args: Any, instance: Any = None, err: Any = None, **kwargs: Any) -> None:
        with self._tree_lock:
            self._close(id_)
        _end_query(id_)  # a query that raised: LlamaIndex sends no QueryEndEvent

    def _close(self, id_: str) -> None:
        self._parents.pop(id_, None)
        self._scoped.pop(id_, None)

    def _root(self, span_id: str | None) -> str | None:
        if span_id not in self._parents:
            return None
        while (parent := self._parents.get(span_id)) in self._parents:
            span_id = parent
        return span_id

    def scope(self, span_id: str | None, candidates: list[SpanCandidate]) -> QueryRecord | None:
        """The record of the outermost open span around `span_id` (a retrieval's), with the retrieval's
        `candidates` added; None where the retrieval is itself outermost (called by hand: its span closes as it
        returns)."""
        with self._tree_lock:
            root = self._root(span_id)
            if root is None or root == span_id:
                return None
            record = self._scoped.get(root)
            if record is None:
                record = self._scoped[root] = QueryRecord(keep_calls=LOOSE_CALLS_KEPT)
            record.candidates.extend(candidates)
            return record

    def record_for(self, span_id: str | None) -> QueryRecord | None:
        with self._tree_lock:
            root = self._root(span_id)
            return self._scoped.get(root) if root is not None else None

    # BaseSpanHandler's abstract hooks (the three above are overridden whole)
    def new_span(self, *args: Any, **kwargs: Any) -> None:
        return None

    def prepare_to_exit_span(self, *args: Any, **kwargs: Any) -> None:
        return None

    def prepare_to_drop_span(self, *args: Any, **kwargs: Any) -> None:
        return None


_tree = _SpanTree()


def _end_query(span_id: str | None) -> None:
    """Close the record of the query whose span this is, in this context, and any opened inside it since."""
    records = _records.get()
    for depth in range(len(records) - 1, -1, -1):
        if span_id is not None and records[depth].span_id == span_id:
            _records.set(records[:depth])
            return


def current_record() -> QueryRecord | None:
    """The innermost query being run in this context; outside a query engine, the retrievals made outside one in
    the outermost instrumented call around this one (a chat turn, an agent's run), else the latest retrieval made
    outside one in this context; None if none."""
    records = _records.get()
    if records:
        return records[-1]
    scoped = _tree.record_for(active_span_id.get())
    return scoped if scoped is not None else _latest.get()


class _NodeTracker(BaseEventHandler):
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @classmethod
    def class_name(cls) -> str:
        return "SpanqNodeTracker"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, QueryStartEvent):
            _records.set((*_records.get(), QueryRecord(span_id=event.span_id)))
        elif isinstance(event, RetrievalEndEvent):
            records = _records.get()
            if records:
                records[-1].add_nodes(list(event.nodes or []))
            else:  # no query: this retrieval's nodes are the ones the next LLM calls here look for
                record = QueryRecord(keep_calls=LOOSE_CALLS_KEPT)
                record.add_nodes(list(event.nodes or []))
                _latest.set(record)
                _tree.scope(event.span_id, record.candidates)  # and the call's around it (an agent's other tasks)
        elif isinstance(event, QueryEndEvent):
            records = _records.get()
            if not records:
                return
            _records.set(records[:-1])
            record = records[-1]
            stream = getattr(event.response, "response_gen", None)
            if stream is not None and (hasattr(stream, "__next__") or hasattr(stream, "__anext__")):
                # A streamed answer: LlamaIndex calls the LLM as it is read, after this event. The record goes
                # on with the stream (for the calls made while it is read), and says what they did at its end.
                replay = _areplay if hasattr(stream, "__anext__") else _replay
                event.response.response_gen = replay(record, stream, event.response)
                return
            _summarize(record, event.response)


def _summarize(record: QueryRecord, response: Any) -> None:
    """What the query's calls did, into `response.metadata["spanq"]` (unless a spanq synthesizer wrote it)."""
    metadata = getattr(response, "metadata", None)
    if record.calls and (metadata is None or "spanq" not in metadata):
        try:
            response.metadata = {**(metadata or {}), "spanq": record.summary()}
        except (AttributeError, ValueError):  # a response type without settable metadata
            pass


def _replay(record: QueryRecord, stream: Any, response: Any) -> Any:
    """A streamed answer's pieces, each read with the query's record current (as while the query ran) — and only
    then: between pieces the reader's own context is as it was."""
    while True:
        before = _records.get()
        _records.set((*before, record))
        try:
            piece = next(stream)
        except StopIteration:
            break
        finally:
            _records.set(before)
        yield piece
    _summarize(record, response)


async def _areplay(record: QueryRecord, stream: Any, response: Any) -> Any:
    """`_replay` for an async stream."""
    while True:
        before = _records.get()
        _records.set((*before, record))
        try:
            piece = await stream.__anext__()
        except StopAsyncIteration:
            break
        finally:
            _records.set(before)
        yield piece
    _summarize(record, response)


_installed: _NodeTracker | None = None
_install_lock = threading.Lock()


def install_tracker() -> None:
    """Add the tracker to LlamaIndex's root dispatcher (once per process)."""
    global _installed
    with _install_lock:
        if _installed is None:
            _installed = _NodeTracker()
            root = get_dispatcher()
            root.add_event_handler(_installed)
            root.add_span_handler(_tree)
