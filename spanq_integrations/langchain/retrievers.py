"""`SpanRetriever`: wrap any retriever so the documents it returns are tagged as order-free spans."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable

from spanq_integrations.langchain.spans import tag_document

__all__ = ["SpanRetriever"]


class SpanRetriever(BaseRetriever):
    """Returns what `retriever` returns, each document tagged as a span (`metadata["spanq"]`, with its id).

    Tagged documents keep their ids through `format_docs_as_spans` into the span blocks and the span query's
    fragments, and are the only ones a model with `recover_documents="tagged"` looks for in its prompt.
    `retriever` may be any runnable from a query string to documents.
    """

    retriever: Runnable[str, list[Document]]

    def __init__(self, retriever: Runnable[str, list[Document]] | None = None, /, **kwargs: Any):
        """`SpanRetriever(retriever)` or `SpanRetriever(retriever=retriever)` (LangChain's keyword form)."""
        if retriever is not None:
            if "retriever" in kwargs:
                raise TypeError("SpanRetriever: the retriever is given twice (positionally and as retriever=)")
            kwargs["retriever"] = retriever
        super().__init__(**kwargs)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        docs = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        return [tag_document(d) for d in docs]

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        docs = await self.retriever.ainvoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        return [tag_document(d) for d in docs]
