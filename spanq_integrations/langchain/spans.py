"""How a LangChain prompt says "this piece is an order-free span": span content blocks and tagged documents.

A **span block** is an ordinary LangChain text content block whose `extras` carry a spanq marker:

    {"type": "text", "text": "<document text>", "extras": {"spanq": {"span": True, "id": "doc-7"}}}

Adjacent span blocks of one message become the children of one `plus` (each a `Fragment`); every other block is
ordinary text of its message. `span_block()` builds one, `format_docs_as_spans()` turns retrieved documents into
one block each. (The shorthand `{"type": "text", "text": ..., "spanq": {"span": True}}` is read too.)

A **tagged document** is a `Document` whose `metadata["spanq"]` is `{"span": True, "id": ...}`; `SpanRetriever`
tags what it returns, and `format_docs_as_spans` keeps the id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.prompts import BasePromptTemplate, PromptTemplate, format_document

__all__ = [
    "DEFAULT_DOCUMENT_SEPARATOR",
    "SPAN_KEY",
    "SpanDocuments",
    "corpus_texts",
    "document_span_id",
    "format_docs_as_spans",
    "is_tagged_document",
    "span_block",
    "span_marker",
    "tag_document",
]

SPAN_KEY = "spanq"
DEFAULT_DOCUMENT_SEPARATOR = "\n\n"  # what LangChain's stuff-documents chain puts between documents


def span_block(text: str, id: str | None = None) -> dict[str, Any]:
    """A text content block marked as an order-free span."""
    marker: dict[str, Any] = {"span": True}
    if id is not None:
        marker["id"] = str(id)
    return {"type": "text", "text": text, "extras": {SPAN_KEY: marker}}


def span_marker(block: Any) -> dict[str, Any] | None:
    """The spanq marker of a content block (`{"span": True, ...}`), or None when it is not a span block."""
    if not isinstance(block, dict) or block.get("type") != "text":
        return None
    extras = block.get("extras")
    marker = extras.get(SPAN_KEY) if isinstance(extras, dict) else None
    if marker is None:
        marker = block.get(SPAN_KEY)
    if isinstance(marker, dict) and marker.get("span"):
        return marker
    return None


def _content_id(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def document_span_id(doc: Document) -> str:
    """A document's span id: its tag's, else its `id`, else `metadata["id"]`, else a hash of its text."""
    marker = doc.metadata.get(SPAN_KEY)
    if isinstance(marker, dict) and marker.get("id"):
        return str(marker["id"])
    if doc.id:
        return str(doc.id)
    if doc.metadata.get("id") is not None:
        return str(doc.metadata["id"])
    return _content_id(doc.page_content)


def is_tagged_document(doc: Any) -> bool:
    """Whether `doc` is a `Document` tagged as a span (by `SpanRetriever` or `tag_document`)."""
    if not isinstance(doc, Document):
        return False
    marker = doc.metadata.get(SPAN_KEY)
    return isinstance(marker, dict) and bool(marker.get("span"))


def tag_document(doc: Document, id: str | None = None) -> Document:
    """A copy of `doc` tagged as an order-free span (metadata["spanq"]); the original is left as it is."""
    marker = {"span": True, "id": id or document_span_id(doc)}
    return doc.model_copy(update={"metadata": {**doc.metadata, SPAN_KEY: marker}})


class SpanDocuments(list):
    """Retrieved documents as span blocks, one per document — and, where a prompt template formats it, text.

    It is a list of content blocks, so it can be spliced into a message's content directly
    (`HumanMessage([*spans, {"type": "text", "text": question}])`). Formatted into a prompt template
    (`"Context:\\n{context}"`) it reads as the documents' texts joined by `separator`, exactly what a usual
    `format_docs` returns, so any model still gets the ordinary prompt, and spanq's models find the documents in
    it again (see `ChatSpanQuery`).
    """

    def __init__(self, blocks: Iterable[dict[str, Any]] = (), separator: str = DEFAULT_DOCUMENT_SEPARATOR):
        super().__init__(blocks)
        self.separator = separator

    @property
    def texts(self) -> list[str]:
        return [b["text"] for b in self]

    @property
    def text(self) -> str:
        return self.separator.join(self.texts)

    def __str__(self) -> str:
        return self.text

    def __format__(self, spec: str) -> str:
        return format(self.text, spec)

    def __repr__(self) -> str:
        return f"SpanDocuments({len(self)} spans)"


def _as_prompt(document_prompt: BasePromptTemplate | str | None) -> BasePromptTemplate | None:
    if document_prompt is None or isinstance(document_prompt, BasePromptTemplate):
        return document_prompt
    return PromptTemplate.from_template(document_prompt)


def format_docs_as_spans(
    docs: Sequence[Document | str],
    document_prompt: BasePromptTemplate | str | None = None,
    separator: str = DEFAULT_DOCUMENT_SEPARATOR,
) -> SpanDocuments:
    """One span block per document: its `page_content`, or `document_prompt` formatted with it.

    A drop-in for the usual `format_docs` step of an LCEL RAG chain (`retriever | format_docs_as_spans`).
    `document_prompt` is what `create_stuff_documents_chain` takes: a template over `page_content` and the
    metadata keys (e.g. `"[{source}] {page_content}"`). No documents give an empty list that formats as "".
    """
    from spanq_integrations.query.errors import ArgumentTypeError

    if isinstance(docs, (str, Document)) or docs is None or not hasattr(docs, "__iter__"):
        raise ArgumentTypeError(
            "format_docs_as_spans(docs)",
            f"takes a list of Documents (or strings), got {type(docs).__name__}: pass the retriever's output"
            + (", or wrap one document in a list" if isinstance(docs, (str, Document)) else ""),
        )
    prompt = _as_prompt(document_prompt)
    blocks = []
    for i, doc in enumerate(docs):
        if isinstance(doc, str):
            doc = Document(page_content=doc)
        if not isinstance(doc, Document):
            raise ArgumentTypeError(
                f"format_docs_as_spans(docs[{i}])",
                f"takes Documents (or strings), got {type(doc).__name__}: pass the retriever's output",
            )
        text = format_document(doc, prompt) if prompt is not None else doc.page_content
        if text.strip():
            blocks.append(span_block(text, id=document_span_id(doc)))
    return SpanDocuments(blocks, separator=separator)


def corpus_texts(
    source: Any,
    document_prompt: BasePromptTemplate | str | None = None,
) -> list[str]:
    """The texts of a corpus's documents as a RAG chain sends them as spans (`format_docs_as_spans` with the same
    `document_prompt`), to compile into a span tier ahead of the queries (`SpanEngine.compile`, `spanq prepare`):
    what the tier holds is then exactly what the chain's queries read. `source` is an `InMemoryVectorStore` (its
    stored documents, what `store.dump(path)` writes and `spanq prepare PATH` reads too) or the documents
    themselves (`Document`s or strings: what was added to any other vector store, which LangChain offers no way
    to list). Empty documents are left out, as the chain leaves them out."""
    from langchain_core.vectorstores import InMemoryVectorStore, VectorStore

    if isinstance(source, InMemoryVectorStore):
        docs: list[Any] = [Document(page_content=v.get("text", ""), metadata=v.get("metadata") or {})
                           for v in source.store.values()]
    elif isinstance(source, VectorStore):
        raise TypeError(
            f"a {type(source).__name__} cannot list its documents through LangChain: pass the documents that were "
            "added to it (or the splitter's output)"
        )
    elif isinstance(source, (str, Document)):
        docs = [source]
    else:
        docs = list(source)
    return format_docs_as_spans(docs, document_prompt).texts
