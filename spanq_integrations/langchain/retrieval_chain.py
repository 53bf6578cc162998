"""`create_span_retrieval_chain`: a drop-in for `create_retrieval_chain` + `create_stuff_documents_chain`
whose retrieved documents reach a spanq model as separate, order-free spans.

    # before
    chain = create_retrieval_chain(retriever, create_stuff_documents_chain(llm, prompt))
    # after
    chain = create_span_retrieval_chain(retriever, prompt, ChatSpanQuery())

Same input (`{"input": ..., **other prompt variables}`), same output (`{"input", "context", "answer"}`), same
prompt. With `ChatSpanQuery` and a chat prompt, the prompt's `{context}` becomes one span block per document
(`format_docs_as_spans`); with `SpanQueryLLM` the formatted documents are passed along as `span_documents`;
any other model gets exactly the prompt the stuff-documents chain would build.
"""

from __future__ import annotations

import secrets
from typing import Any

from langchain_core.documents import Document
from langchain_core.language_models import BaseLanguageModel
from langchain_core.messages import BaseMessage
from langchain_core.output_parsers import BaseOutputParser, StrOutputParser
from langchain_core.prompts import BasePromptTemplate, ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableBinding, RunnableLambda, RunnablePassthrough

from spanq_integrations.langchain.chat_models import ChatSpanQuery
from spanq_integrations.langchain.client import SpanQueryClient
from spanq_integrations.langchain.spans import DEFAULT_DOCUMENT_SEPARATOR, SpanDocuments, format_docs_as_spans
from spanq_integrations.query.errors import SpanQueryError

__all__ = ["NoDocumentsError", "create_span_documents_chain", "create_span_retrieval_chain"]

DOCUMENTS_KEY = "context"


class NoDocumentsError(SpanQueryError):
    """The retriever returned no documents and the chain was built with `require_documents=True`."""


def _spanq_model(llm: Runnable) -> SpanQueryClient | None:
    """The spanq model behind `llm` (also through `.bind(...)`), or None."""
    while isinstance(llm, RunnableBinding):
        llm = llm.bound
    return llm if isinstance(llm, SpanQueryClient) else None


def _messages_with_span_blocks(
    prompt: ChatPromptTemplate, inputs: dict[str, Any], variable: str, spans: SpanDocuments
) -> list[BaseMessage] | None:
    """The prompt's messages with the documents' place filled by span blocks (None if it has no such place)."""
    sentinel = f"\u27e6spanq-documents:{secrets.token_hex(8)}\u27e7"
    messages = prompt.invoke({**inputs, variable: sentinel}).to_messages()
    filled, places = [], 0
    for message in messages:
        if not isinstance(message.content, str) or sentinel not in message.content:
            if sentinel in str(message.content):
                return None  # somewhere a string template cannot reach: leave it to ordinary formatting
            filled.append(message)
            continue
        blocks: list[Any] = []
        for i, text in enumerate(message.content.split(sentinel)):
            if i:
                blocks.extend(spans)
                places += 1
            if text:
                blocks.append({"type": "text", "text": text})
        filled.append(message.model_copy(update={"content": blocks}))
    return filled if places else None


def create_span_documents_chain(
    llm: BaseLanguageModel | Runnable,
    prompt: BasePromptTemplate,
    *,
    output_parser: BaseOutputParser | None = None,
    document_prompt: BasePromptTemplate | str | None = None,
    document_separator: str = DEFAULT_DOCUMENT_SEPARATOR,
    document_variable_name: str = DOCUMENTS_KEY,
    require_documents: bool = False,
) -> Runnable[dict[str, Any], Any]:
    """A drop-in for `create_stuff_documents_chain`: `{"context": [Document, ...], ...}` → the parsed answer.

    No documents: the prompt is sent with an empty context (as the stuff-documents chain does), unless
    `require_documents=True`, which raises `NoDocumentsError` instead.
    """
    if document_variable_name not in prompt.input_variables:
        raise ValueError(
            f"the prompt must take {document_variable_name!r} as an input variable; it takes "
            f"{prompt.input_variables}"
        )
    parser = output_parser or StrOutputParser()
    model = _spanq_model(llm)

    def with_documents(inputs: dict[str, Any]) -> Runnable:
        docs = inputs.get(document_variable_name) or []
        if not docs and require_documents:
            raise NoDocumentsError(
                "the retriever returned no documents; the chain was built with require_documents=True "
                "(leave it False to answer from an empty context)"
            )
        spans = format_docs_as_spans(docs, document_prompt, document_separator)
        if isinstance(model, ChatSpanQuery) and isinstance(prompt, ChatPromptTemplate):
            messages = _messages_with_span_blocks(prompt, inputs, document_variable_name, spans)
            if messages is not None:
                return RunnableLambda(lambda _: messages, name="span_prompt") | llm | parser
        fill = RunnableLambda(lambda x: {**x, document_variable_name: spans}).with_config(
            run_name="format_documents"
        )
        target = llm.bind(span_documents=spans) if model is not None and docs else llm
        return fill | prompt | target | parser

    return RunnableLambda(with_documents).with_config(run_name="span_documents_chain")


def create_span_retrieval_chain(
    retriever: BaseRetriever | Runnable[dict[str, Any], list[Document]],
    prompt: BasePromptTemplate,
    llm: BaseLanguageModel | Runnable,
    **documents_chain_options: Any,
) -> Runnable[dict[str, Any], dict[str, Any]]:
    """A drop-in for `create_retrieval_chain(retriever, create_stuff_documents_chain(llm, prompt))`.

    Input: a dict with `"input"` (the query) and the prompt's other variables. Output: the input plus
    `"context"` (the retrieved documents) and `"answer"`. `retriever` may also be a runnable from the input
    dict to documents (for example a history-aware retriever). `documents_chain_options` go to
    `create_span_documents_chain` (`document_prompt`, `document_separator`, `output_parser`,
    `require_documents`, ...).
    """
    if isinstance(retriever, BaseRetriever):
        retrieve: Runnable = RunnableLambda(lambda x: x["input"]).with_config(run_name="query") | retriever
    else:
        retrieve = retriever
    answer = create_span_documents_chain(llm, prompt, **documents_chain_options)
    return (
        RunnablePassthrough.assign(context=retrieve.with_config(run_name="retrieve_documents"))
        .assign(answer=answer)
        .with_config(run_name="span_retrieval_chain")
    )
