"""Fixtures of the LlamaIndex adapter tests: an LLM on the shared tiny engine, the offline embedding model, a
small index of short local documents, and a collector of LlamaIndex instrumentation events."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.node_parser import SentenceSplitter

from spanq_integrations.llamaindex import MiniLMEmbedding, SpanQueryLLM

TOWNS = {
    "harbor": "Lindale Harbor is a fishing town on the north coast. Its town hall is painted sea green.",
    "orchard": "Brackwell is an orchard village in the south. Its town hall is painted bright yellow.",
    "mining": "Corrow Ridge is an old mining town in the mountains. Its town hall is painted dark red.",
    "river": "Pell Crossing grew around a stone bridge over a river. Its town hall is painted pale blue.",
}


@pytest.fixture
def span_llm(tiny_backend) -> SpanQueryLLM:
    """A SpanQueryLLM on the session's tiny engine; short answers (the tiny model's text is gibberish)."""
    return SpanQueryLLM(backend=tiny_backend, max_tokens=6, temperature=0.0)


@pytest.fixture(scope="session")
def embed_model() -> MiniLMEmbedding:
    return MiniLMEmbedding()


@pytest.fixture(scope="session")
def town_index(embed_model) -> VectorStoreIndex:
    """One node per town (the documents are short), embedded offline with MiniLM."""
    documents = [Document(text=text, id_=name, metadata={"town": name}) for name, text in TOWNS.items()]
    splitter = SentenceSplitter(chunk_size=256, chunk_overlap=0)
    return VectorStoreIndex.from_documents(documents, embed_model=embed_model, transformations=[splitter])


class EventCollector(BaseEventHandler):
    """Keeps every instrumentation event the root dispatcher sees."""

    events: list[Any] = Field(default_factory=list)

    def handle(self, event: Any, **kwargs: Any) -> None:
        self.events.append(event)

    def names(self) -> list[str]:
        return [type(e).__name__ for e in self.events]


@pytest.fixture
def events() -> Iterator[EventCollector]:
    collector = EventCollector()
    root = get_dispatcher()
    root.add_event_handler(collector)
    try:
        yield collector
    finally:
        root.event_handlers.remove(collector)
