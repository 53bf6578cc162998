"""Span blocks, tagged documents, and the documents a run retrieved — no model needed."""

from __future__ import annotations

import pytest
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough

from spanq_integrations.langchain import (
    SpanRetriever,
    format_docs_as_spans,
    is_tagged_document,
    span_marker,
    tag_document,
)
from spanq_integrations.langchain.run_documents import run_document_tracker
from tests.langchain.rag_app import OrderedRetriever, format_docs, town_documents


def test_one_span_block_per_document_that_formats_like_format_docs():
    docs = town_documents("spans")
    spans = format_docs_as_spans(docs)
    assert len(spans) == 4
    assert [span_marker(b)["id"] for b in spans] == [d.id for d in docs]
    prompt = ChatPromptTemplate.from_messages([("system", "Context:\n{context}"), ("human", "{question}")])
    with_spans = prompt.invoke({"context": spans, "question": "q"}).to_messages()
    plain = prompt.invoke({"context": format_docs(docs), "question": "q"}).to_messages()
    assert with_spans == plain


def test_document_prompt_formats_each_block():
    docs = town_documents("prompt")
    spans = format_docs_as_spans(docs, document_prompt="[{source}] {page_content}")
    assert spans.texts[0] == f"[harbor] {docs[0].page_content}"
    assert format_docs_as_spans([]) == [] and f"{format_docs_as_spans([])}" == ""


def test_span_retriever_tags_what_the_wrapped_retriever_returns():
    docs = town_documents("tag")
    retriever = SpanRetriever(retriever=OrderedRetriever(documents=docs, orders=[[2, 0]]))
    got = retriever.invoke("anything")
    assert [d.id for d in got] == [docs[2].id, docs[0].id]
    assert all(is_tagged_document(d) for d in got)
    assert not is_tagged_document(docs[2])  # the originals are left as they were
    assert tag_document(docs[1]).metadata["spanq"] == {"span": True, "id": docs[1].id}
    # the README's form, positional (a pydantic model took keywords only: a TypeError)
    wrapped = OrderedRetriever(documents=docs, orders=[[1]])
    assert [d.id for d in SpanRetriever(wrapped).invoke("q")] == [docs[1].id]
    with pytest.raises(TypeError, match="given twice"):
        SpanRetriever(wrapped, retriever=wrapped)


def test_the_tracker_sees_the_documents_of_the_run_and_forgets_them_after():
    docs = town_documents("tracker")
    seen = {}

    def model_step(prompt_value, run_manager):
        seen["candidates"] = run_document_tracker().candidates(run_manager.run_id)
        seen["tagged"] = run_document_tracker().candidates(run_manager.run_id, tagged_only=True)
        return "answer"

    retriever = OrderedRetriever(documents=docs, orders=[[1, 3]])
    prompt = ChatPromptTemplate.from_messages([("system", "Context:\n{context}"), ("human", "{question}")])
    chain = (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | prompt
        | RunnableLambda(model_step)
    )
    before = run_document_tracker().tracked_roots
    assert chain.invoke("q") == "answer"
    assert [c.id for c in seen["candidates"]] == [docs[1].id, docs[3].id]
    assert seen["tagged"] == []
    assert run_document_tracker().tracked_roots == before
