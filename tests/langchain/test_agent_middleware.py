"""LangChain 1.x agents (`langchain.agents.create_agent`) with the model swapped for `ChatSpanQuery`: the documents
a tool returns are read as spans, so a second conversation that opens differently and retrieves the same documents
in another order computes none of them again.

- With only the model swapped, spanq's run tracker sees the documents a tool retrieved (a retriever run inside it,
  or the tool's artifact) and finds them in the tool's text (`span_source` "run_documents").
- `SpanCacheMiddleware` marks a tool's documents as spans in the tool message itself, so nothing depends on
  finding them again: with document recovery off (`recover_documents="off"`, where callbacks do not reach the tool
  or the text is not the documents' own) it still reads them as spans; without it the same agent reads them as
  text — the check fails there, shown below.
"""

from __future__ import annotations

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from spanq_integrations.langchain import ChatSpanQuery, SpanCacheMiddleware, span_marker
from tests.langchain.rag_app import OrderedRetriever, document_tokens, town_documents

pytestmark = pytest.mark.vllm

QUESTION = "What color is the town hall of Corrow Ridge?"
ORDERS = [[0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0], [1, 0, 3, 2]]


class SearchFirst(AgentMiddleware):
    """The app's own rule: search before answering, then answer from what was found (it also makes the random
    tiny model's run go the same way every time)."""

    def wrap_model_call(self, request, handler):
        searched = any(isinstance(m, ToolMessage) for m in request.messages)
        return handler(request.override(tool_choice="none" if searched else "any"))


class Search(BaseModel):
    query: str = Field(description="words to look for", max_length=20)  # bounded: the random model's call ends


def search_tool(find):
    """A search tool as `create_retriever_tool(..., response_format="content_and_artifact")` makes one — the
    documents' text as content, the documents as artifact — over `find(query) -> documents`, with a bounded
    argument for the random model."""

    @tool("search_towns", args_schema=Search, response_format="content_and_artifact")
    def search_towns(query: str):
        """Search the town documents."""
        docs = find(query)
        return "\n\n".join(d.page_content for d in docs), docs

    return search_towns


def retriever_tool(retriever):
    """The search tool over a LangChain retriever (its run is traced: spanq's tracker sees what it found)."""
    return search_tool(retriever.invoke)


def lookup_tool(docs):
    """The search tool without a LangChain retriever (as a search API's client would be): each call serves the
    documents in the next of `ORDERS`."""
    calls = iter(ORDERS * 4)
    return search_tool(lambda _query: [docs[i] for i in next(calls)])


def run(compact_tiny, search, system_prompt, middleware, recover="auto"):
    model = ChatSpanQuery(backend=compact_tiny, max_tokens=64, temperature=0, recover_documents=recover)
    agent = create_agent(model, tools=[search], system_prompt=system_prompt, middleware=[SearchFirst(), *middleware])
    messages = agent.invoke({"messages": [HumanMessage(QUESTION)]})["messages"]
    tool_messages = [m for m in messages if isinstance(m, ToolMessage)]
    answer = messages[-1]
    assert isinstance(answer, AIMessage) and not answer.tool_calls and len(tool_messages) == 1
    return tool_messages[0], answer


def test_an_agent_with_only_the_model_swapped_reads_its_retriever_tools_documents_as_spans(compact_tiny):
    docs = town_documents("agent")
    retriever = OrderedRetriever(documents=docs, orders=ORDERS)
    _, first = run(compact_tiny, retriever_tool(retriever), "You answer questions about towns.", [])
    assert first.response_metadata["spanq"]["spans"] == 4
    # Another conversation: another system prompt, the same documents retrieved in another order.
    _, second = run(compact_tiny, retriever_tool(retriever), "Be brief. Use the search tool.", [])
    assert retriever.served[0] != retriever.served[1]
    spanq = second.response_metadata["spanq"]
    assert spanq["spans"] == 4 and spanq["span_source"] == "run_documents"
    assert spanq["prepared_spans"] == 0  # nothing left to compute
    assert second.usage_metadata["input_token_details"]["cache_read"] >= document_tokens(compact_tiny, docs)


def test_the_middleware_marks_a_tools_documents_as_spans_in_the_message(compact_tiny):
    docs = town_documents("agent-lookup")
    search = lookup_tool(docs)
    middleware = [SpanCacheMiddleware()]
    found, first = run(compact_tiny, search, "You answer questions about towns.", middleware, recover="off")
    assert [span_marker(b) is not None for b in found.content] == [True] * 4  # one span block per document
    assert first.response_metadata["spanq"]["spans"] == 4
    _, second = run(compact_tiny, search, "Be brief. Use the search tool.", middleware, recover="off")
    spanq = second.response_metadata["spanq"]
    assert spanq["spans"] == 4 and spanq["prepared_spans"] == 0
    assert second.usage_metadata["input_token_details"]["cache_read"] >= document_tokens(compact_tiny, docs)


def test_without_the_middleware_and_recovery_the_documents_are_text(compact_tiny):
    """The check above can fail: the same agent without `SpanCacheMiddleware` reads the documents as text."""
    docs = town_documents("agent-plain")
    search = lookup_tool(docs)
    run(compact_tiny, search, "You answer questions about towns.", [], recover="off")
    found, second = run(compact_tiny, search, "Be brief. Use the search tool.", [], recover="off")
    assert isinstance(found.content, str)
    assert second.response_metadata["spanq"]["spans"] == 0
    assert second.usage_metadata["input_token_details"]["cache_read"] < document_tokens(compact_tiny, docs)


def test_only_tool_messages_that_carry_documents_are_marked():
    """Other tool results, failed calls and tools not named stay as they are."""
    from langchain_core.documents import Document

    mark = SpanCacheMiddleware(tool_names=["search"]).mark
    docs = [Document(page_content="Doc one."), Document(page_content="Doc two.")]
    hit = mark(ToolMessage("Doc one.\n\nDoc two.", tool_call_id="c", name="search", artifact=docs))
    assert [b["text"] for b in hit.content] == ["Doc one.", "Doc two."]
    for message in (
        ToolMessage("42", tool_call_id="c", name="search"),  # no documents
        ToolMessage("x", tool_call_id="c", name="other", artifact=docs),  # not a named tool
        ToolMessage("boom", tool_call_id="c", name="search", artifact=docs, status="error"),
    ):
        assert mark(message) is message
