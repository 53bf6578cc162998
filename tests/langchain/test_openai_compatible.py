"""`ChatSpanQuery` on an unmodified OpenAI-compatible server (a real `vllm serve`): spans are flattened into
ordinary messages, so the server gets nothing it could reject, and everything else works as on the engine."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from spanq_integrations.langchain import ChatSpanQuery, SpanQueryLLM, format_docs_as_spans
from tests.langchain.rag_app import OrderedRetriever, format_docs, town_documents

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_span_blocks_are_flattened_for_a_stock_server(stock_vllm_server):
    llm = ChatSpanQuery(backend=f"{stock_vllm_server}/v1", model="tiny", max_tokens=4, temperature=0)
    docs = town_documents("stock")
    messages = [
        SystemMessage("Answer using only the documents."),
        HumanMessage([*format_docs_as_spans(docs), "Which town has a ferry?"]),
    ]
    first = llm.invoke(messages)
    assert isinstance(first.content, str) and first.response_metadata["model_name"] == "tiny"
    assert first.response_metadata["spanq"]["span_aware"] is False
    assert first.response_metadata["spanq"]["spans"] == 0  # flattened: the server saw one ordinary message
    assert "not span-aware" in first.response_metadata["spanq"]["fallback"]
    again = llm.invoke(messages)
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0  # the stock prefix cache still works

    chunks = list(llm.stream(messages))
    assert (
        chunks[-1].chunk_position == "last" and sum(chunks[1:], chunks[0]).usage_metadata["input_tokens"] > 0
    )

    prompt = ChatPromptTemplate.from_messages([("system", "Context:\n{context}"), ("human", "{q}")])
    app = {
        "context": OrderedRetriever(documents=docs, orders=[[1, 0, 3, 2]]) | format_docs,
        "q": RunnablePassthrough(),
    }
    message = (app | prompt | llm).invoke("Which town is in the mountains?")
    assert message.response_metadata["spanq"]["spans"] == 0
    assert "sent as it is" in message.response_metadata["spanq"]["fallback"]
    llm.close()

    text_llm = SpanQueryLLM(backend=stock_vllm_server, model="tiny", max_tokens=4)
    assert isinstance(text_llm.invoke("Say hello."), str)
    text_llm.close()
