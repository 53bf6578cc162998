"""What the RAG tests share: four town documents, a retriever that serves them in set orders, `format_docs`."""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import Field

TOWNS = [
    (
        "harbor",
        (
            "Lindale Harbor is a fishing town on the north coast. Its town hall, built in 1887, is painted sea green, "
            "and the ferry to the islands leaves twice a day from pier three."
        ),
    ),
    (
        "orchard",
        (
            "Brackwell is an orchard village in the southern valley. Its town hall is painted bright yellow, and the "
            "cider press in the market square runs from September to November."
        ),
    ),
    (
        "mining",
        (
            "Corrow Ridge is an old mining town high in the mountains. The town hall is painted dark red, the color of "
            "the iron ore once dug there; the road over the pass closes in winter."
        ),
    ),
    (
        "river",
        (
            "Pell Crossing grew around a stone bridge over the river Ouse. Its town hall is painted pale blue and "
            "stands beside the old toll house; a weekly boat market sells fish and wool."
        ),
    ),
]


def town_documents(tag: str) -> list[Document]:
    """The four town documents, made unique to `tag` so no other test has put them in the span cache: from their
    first block on (a document's whole blocks are read from the cache wherever they were cached: with the tag at
    its end, its first block was every test's)."""
    return [
        Document(page_content=f"(Record {tag}-{name}.) {text}", id=f"{tag}-{name}", metadata={"source": name})
        for name, text in TOWNS
    ]


class OrderedRetriever(BaseRetriever):
    """Serves `documents` in the next of `orders` (index lists) on each call, cycling; records what it served."""

    documents: list[Document]
    orders: list[list[int]]
    served: list[list[str]] = Field(default_factory=list)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        order = self.orders[len(self.served) % len(self.orders)]
        docs = [self.documents[i] for i in order]
        self.served.append([d.id for d in docs])
        return docs


def format_docs(docs: Sequence[Document]) -> str:
    """The `format_docs` of LangChain's RAG tutorials."""
    return "\n\n".join(doc.page_content for doc in docs)


def token_count(backend, text: str) -> int:
    return len(backend.engine.tokenizer.encode(text, add_special_tokens=False))


def document_tokens(backend, docs) -> int:
    return sum(token_count(backend, d.page_content) for d in docs)
