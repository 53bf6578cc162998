"""The RAG app of a LangChain user, with only the LLM swapped: documents retrieved in a new order come from the
span cache, and the answer comes back through invoke, batch, stream and astream."""

from __future__ import annotations

import asyncio
from typing import TypedDict

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph

from spanq_integrations.langchain import (
    ChatSpanQuery,
    SpanQueryLLM,
    SpanRetriever,
    create_span_retrieval_chain,
    format_docs_as_spans,
)
from tests.langchain.rag_app import (
    OrderedRetriever,
    document_tokens,
    format_docs,
    town_documents,
)

pytestmark = pytest.mark.vllm

PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer the question using only the context. Be brief.\n\nContext:\n{context}"),
        ("human", "{question}"),
    ]
)
QUESTION = "What color is the town hall of Corrow Ridge?"
ORDERS = [[0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0], [1, 0, 3, 2], [0, 2, 3, 1], [3, 0, 2, 1]]


class GraphState(TypedDict):
    question: str
    context: list[Document]
    answer: AIMessage


def rag_app(retriever, llm, format_step=format_docs):
    """LangChain's RAG tutorial chain, as written there."""
    return {"context": retriever | format_step, "question": RunnablePassthrough()} | PROMPT | llm


def stats(message) -> dict:
    return message.response_metadata["spanq"]


def cache_read(message) -> int:
    return message.usage_metadata["input_token_details"]["cache_read"]


def test_reordered_documents_are_read_from_the_span_cache(tiny_backend, chat):
    docs = town_documents("reorder")
    retriever = OrderedRetriever(documents=docs, orders=ORDERS)
    app = rag_app(retriever, chat)

    first = app.invoke(QUESTION)
    second = app.invoke(QUESTION)

    assert retriever.served[0] != retriever.served[1]  # the same documents, in a different order
    for message in (first, second):
        assert isinstance(message, AIMessage) and isinstance(message.content, str)
        assert stats(message)["spans"] == 4
        assert stats(message)["span_source"] == "run_documents"
    assert stats(first)["prepared_spans"] >= 1
    assert stats(second)["prepared_spans"] == 0  # nothing left to compute: every document was cached
    assert cache_read(second) >= document_tokens(tiny_backend, docs)
    assert message.usage_metadata["input_tokens"] >= cache_read(second)


def test_recompute_is_an_adapter_setting(tiny_backend):
    """`ChatSpanQuery(recompute=...)`: the documents are still read from the span cache, and each one's first block
    is computed again in context (what `response_metadata["spanq"]` reports)."""
    from spanq_integrations.langchain import ChatSpanQuery

    docs = town_documents("recompute")
    plain = ChatSpanQuery(backend=tiny_backend, max_tokens=4, temperature=0)
    redo = ChatSpanQuery(backend=tiny_backend, max_tokens=4, temperature=0, recompute="first")
    first = rag_app(OrderedRetriever(documents=docs, orders=ORDERS), plain).invoke(QUESTION)
    second = rag_app(OrderedRetriever(documents=docs, orders=ORDERS[1:]), redo).invoke(QUESTION)
    assert stats(first)["recomputed_tokens"] == 0
    assert stats(second)["prepared_spans"] == 0 and stats(second)["spans"] == 4
    assert stats(second)["recomputed_tokens"] == 4 * 32


def test_without_spans_the_reordered_documents_miss_the_cache(tiny_backend):
    docs = town_documents("plain")
    llm = ChatSpanQuery(backend=tiny_backend, max_tokens=4, temperature=0, recover_documents="off")
    app = rag_app(OrderedRetriever(documents=docs, orders=ORDERS), llm)
    app.invoke(QUESTION)
    second = app.invoke(QUESTION)
    assert stats(second)["spans"] == 0 and stats(second)["span_source"] is None
    assert cache_read(second) < document_tokens(tiny_backend, docs)


def test_batch_stream_and_astream_answer_through_the_span_cache(tiny_backend, chat):
    docs = town_documents("interfaces")
    app = rag_app(OrderedRetriever(documents=docs, orders=ORDERS), chat)
    app.invoke(QUESTION)  # puts the documents in the cache
    needed = document_tokens(tiny_backend, docs)

    batch = app.batch([QUESTION, "Which town has a ferry?"])
    assert len(batch) == 2
    for message in batch:
        assert isinstance(message, AIMessage) and message.content
        assert stats(message)["spans"] == 4 and cache_read(message) >= needed

    tokens: list[str] = []

    class Tokens(BaseCallbackHandler):
        def on_llm_new_token(self, token: str, **kwargs) -> None:
            tokens.append(token)

    chunks = list(app.stream(QUESTION, config={"callbacks": [Tokens()]}))
    assert all(isinstance(c, AIMessageChunk) for c in chunks) and len(chunks) >= 2
    full = sum(chunks[1:], chunks[0])
    assert full.content and "".join(tokens) == full.content
    assert chunks[-1].chunk_position == "last"
    assert stats(full)["spans"] == 4 and cache_read(full) >= needed


async def test_astream_and_ainvoke(tiny_backend, chat):
    docs = town_documents("async")
    app = rag_app(OrderedRetriever(documents=docs, orders=ORDERS), chat)
    await app.ainvoke(QUESTION)
    chunks = [c async for c in app.astream(QUESTION)]
    full = sum(chunks[1:], chunks[0])
    assert full.content and stats(full)["spans"] == 4
    assert stats(full)["prepared_spans"] == 0
    assert cache_read(full) >= document_tokens(tiny_backend, docs)


def test_streaming_true_invoke_reports_each_token(chat):
    tokens: list[str] = []

    class Tokens(BaseCallbackHandler):
        def on_llm_new_token(self, token: str, **kwargs) -> None:
            tokens.append(token)

    llm = chat.model_copy(update={"streaming": True})
    message = llm.invoke("Say hello.", config={"callbacks": [Tokens()]})
    assert tokens and "".join(tokens) == message.content


async def test_the_text_llm_with_streaming_true_reports_each_token_on_invoke_and_ainvoke(tiny_backend):
    """As ChatOpenAI-style LLMs do: `streaming=True` hands each piece to `on_llm_new_token`, whichever way the
    LLM is called (the async path once gave none)."""
    from langchain_core.callbacks import AsyncCallbackHandler

    class Tokens(AsyncCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        async def on_llm_new_token(self, token: str, **kwargs) -> None:
            self.tokens.append(token)

    llm = SpanQueryLLM(backend=tiny_backend, max_tokens=6, temperature=0, streaming=True)
    sync, in_async = Tokens(), Tokens()
    text = await asyncio.to_thread(llm.invoke, "Say hello.", config={"callbacks": [sync]})
    again = await llm.ainvoke("Say hello.", config={"callbacks": [in_async]})
    assert sync.tokens and "".join(sync.tokens) == text
    assert in_async.tokens and "".join(in_async.tokens) == again == text


def test_one_line_changed_format_docs_as_spans_with_document_headers(tiny_backend, chat):
    """`format_docs` that adds per-document headers cannot be cut safely; `format_docs_as_spans` can."""
    docs = town_documents("headers")

    def format_with_sources(docs):
        return "\n\n".join(f"[{d.metadata['source']}] {d.page_content}" for d in docs)

    unchanged = rag_app(OrderedRetriever(documents=docs, orders=ORDERS), chat, format_with_sources)
    plain = unchanged.invoke(QUESTION)
    assert stats(plain)["spans"] == 0 and "format_docs_as_spans" in stats(plain)["fallback"]

    def spans_with_sources(docs):
        return format_docs_as_spans(docs, document_prompt="[{source}] {page_content}")

    changed = rag_app(OrderedRetriever(documents=docs, orders=ORDERS[1:]), chat, spans_with_sources)
    first, second = changed.invoke(QUESTION), changed.invoke(QUESTION)
    assert stats(first)["spans"] == stats(second)["spans"] == 4
    assert stats(second)["prepared_spans"] == 0
    assert cache_read(second) >= document_tokens(tiny_backend, docs)


def test_create_span_retrieval_chain_is_a_drop_in(tiny_backend, chat):
    docs = town_documents("dropin")
    retriever = OrderedRetriever(documents=docs, orders=ORDERS)
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer using only this context:\n\n{context}"), ("human", "{input}")]
    )
    chain = create_span_retrieval_chain(retriever, prompt, chat)

    first = chain.invoke({"input": QUESTION})
    assert set(first) == {"input", "context", "answer"}
    assert [d.id for d in first["context"]] == retriever.served[0]
    assert isinstance(first["answer"], str)

    seen: list[dict] = []

    class Ends(BaseCallbackHandler):
        def on_llm_end(self, response, **kwargs) -> None:
            seen.append(response.generations[0][0].message.response_metadata["spanq"])

    pieces = list(chain.stream({"input": QUESTION}, config={"callbacks": [Ends()]}))
    answer = "".join(p["answer"] for p in pieces if "answer" in p)
    assert isinstance(answer, str) and len([p for p in pieces if "answer" in p]) >= 1
    (spanq,) = seen
    assert spanq["span_source"] == "content_blocks" and spanq["spans"] == 4 and spanq["prepared_spans"] == 0
    assert spanq["cached_tokens"] >= document_tokens(tiny_backend, docs)


def test_span_retriever_and_tagged_recovery(tiny_backend):
    docs = town_documents("tagged")
    llm = ChatSpanQuery(backend=tiny_backend, max_tokens=4, temperature=0, recover_documents="tagged")
    untagged = rag_app(OrderedRetriever(documents=docs, orders=ORDERS), llm).invoke(QUESTION)
    assert stats(untagged)["spans"] == 0
    # and says why (it said nothing: no spans, no fallback)
    assert "none tagged as a span; wrap the retriever in SpanRetriever" in stats(untagged)["fallback"]
    tagged = rag_app(SpanRetriever(retriever=OrderedRetriever(documents=docs, orders=ORDERS)), llm).invoke(
        QUESTION
    )
    assert stats(tagged)["spans"] == 4 and stats(tagged)["span_source"] == "run_documents"


def test_span_query_llm_with_a_string_prompt(tiny_backend):
    docs = town_documents("llm")
    llm = SpanQueryLLM(backend=tiny_backend, max_tokens=4, temperature=0)
    prompt = PromptTemplate.from_template("Context:\n{context}\n\nQuestion: {question}\nAnswer:")
    retriever = OrderedRetriever(documents=docs, orders=ORDERS)
    app = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    first = app.invoke(QUESTION)
    assert isinstance(first, str)
    result = llm.generate(
        [prompt.format(context=format_docs(docs[::-1]), question=QUESTION)], span_documents=docs
    )
    info = result.generations[0][0].generation_info
    assert info["spanq"]["spans"] == 4 and info["spanq"]["span_source"] == "span_documents"
    assert info["spanq"]["prepared_spans"] == 0
    assert info["usage_metadata"]["input_token_details"]["cache_read"] >= document_tokens(tiny_backend, docs)
    assert "".join(app.stream(QUESTION))
    chain = create_span_retrieval_chain(
        retriever, PromptTemplate.from_template("{context}\n\nQ: {input}\nA:"), llm
    )
    assert isinstance(chain.invoke({"input": QUESTION})["answer"], str)


@pytest.mark.parametrize("call", ["batch", "abatch"])
def test_the_text_llm_finds_each_batched_prompts_own_documents(tiny_backend, call):
    """`chain.batch([q1, q2])` through the text LLM: LangChain hands `_generate` the first prompt's run only, so
    the second prompt was matched against the first one's documents (0 spans, and advice to change its
    formatting, though `invoke` found all four)."""
    from langchain_core.retrievers import BaseRetriever

    by_question = {"first": town_documents("batch-a"), "second": town_documents("batch-b")}

    class ByQuestion(BaseRetriever):
        def _get_relevant_documents(self, query, *, run_manager=None):
            return by_question[query]

    asked: dict = {}
    seen: dict[str, dict] = {}

    class Ends(BaseCallbackHandler):
        run_inline = True  # (under abatch, in order: not each event in a thread of its own)

        def on_llm_start(self, serialized, prompts, *, run_id, **kwargs) -> None:
            asked[run_id] = prompts[0].rsplit("Question: ", 1)[1].split("\n")[0]

        def on_llm_end(self, response, *, run_id, **kwargs) -> None:
            seen[asked[run_id]] = response.generations[0][0].generation_info["spanq"]

    llm = SpanQueryLLM(backend=tiny_backend, max_tokens=2, temperature=0)
    prompt = PromptTemplate.from_template("Context:\n{context}\n\nQuestion: {question}\nAnswer:")
    app = {"context": ByQuestion() | format_docs, "question": RunnablePassthrough()} | prompt | llm
    questions = ["first", "second"]
    config = {"callbacks": [Ends()]}
    answers = app.batch(questions, config=config) if call == "batch" else asyncio.run(app.abatch(questions, config=config))
    assert len(answers) == 2
    assert [(seen[q]["spans"], seen[q]["fallback"]) for q in questions] == [(4, None), (4, None)], seen


def test_a_langgraph_rag_app_works_unchanged(tiny_backend, chat):
    """LangGraph's RAG tutorial: a `retrieve` node returns {"context": docs}, `generate` formats and calls the LLM."""
    docs = town_documents("graph")
    orders = iter(ORDERS)

    def retrieve(state: GraphState) -> dict:  # a vector store search, no retriever run
        return {"context": [docs[i] for i in next(orders)]}

    def generate(state: GraphState) -> dict:
        docs_content = "\n\n".join(doc.page_content for doc in state["context"])
        messages = PROMPT.invoke({"question": state["question"], "context": docs_content})
        return {"answer": chat.invoke(messages)}

    graph = StateGraph(GraphState).add_sequence([retrieve, generate])
    graph.add_edge(START, "retrieve")
    app = graph.compile()
    app.invoke({"question": QUESTION})
    second = app.invoke({"question": QUESTION})["answer"]
    assert stats(second)["spans"] == 4 and stats(second)["span_source"] == "run_documents"
    assert stats(second)["prepared_spans"] == 0
    assert cache_read(second) >= document_tokens(tiny_backend, docs)


# LangChain hub's rlm/rag-prompt, written out (the hub is not reachable here): one human message, the question
# before the context.
HUB_RAG_TEXT = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, just say that you don't know. Use three sentences maximum and "
    "keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:"
)
HUB_RAG_PROMPT = ChatPromptTemplate.from_messages([("human", HUB_RAG_TEXT)])


def test_the_hub_rag_prompt_reuses_documents_across_questions(tiny_backend, chat):
    """The question comes before the documents: under the default anchor the documents of the first question
    are read from the cache for the second, and neither call counts what it computed as cache_read."""
    docs = town_documents("hub")
    retriever = OrderedRetriever(documents=docs, orders=ORDERS)
    app = {"context": retriever | format_docs, "question": RunnablePassthrough()} | HUB_RAG_PROMPT | chat

    first = app.invoke("What color is the town hall of Corrow Ridge?")
    second = app.invoke("Which town has the dark red town hall?")

    assert stats(first)["spans"] == stats(second)["spans"] == 4
    assert stats(first)["prepared_spans"] == 4
    assert stats(second)["prepared_spans"] == 0, "the second question found every document cached"
    assert cache_read(first) < document_tokens(tiny_backend, docs), "a cold call reads no document from cache"
    assert cache_read(second) >= document_tokens(tiny_backend, docs)
    assert stats(first)["prepared_tokens"] >= document_tokens(tiny_backend, docs)
    # LangChain's name for what a call wrote to the cache (#33 item 3): the first call its documents, the second
    # only its own prefix (the question comes first here), no document
    written = [m.usage_metadata["input_token_details"]["cache_creation"] for m in (first, second)]
    assert written == [stats(first)["prepared_tokens"], stats(second)["prepared_tokens"]]
    assert written[0] >= document_tokens(tiny_backend, docs) > written[1]


class AgentState(TypedDict):
    messages: list
    plan: list[list[int]]


def test_a_langgraph_agent_reuses_what_its_tool_returned_in_earlier_steps_and_other_conversations(
    tiny_backend, chat
):
    """An agent loop: each step calls a search tool that returns documents, appends them to the growing
    transcript and asks the model. A step prepares only the documents no step of any conversation read before,
    whatever opened the conversation; the documents stay in the transcript (several groups in one prompt)."""
    docs = town_documents("agent")

    @tool
    def search(query: str, picks: list[int]) -> list[Document]:
        """Search the town records."""
        return [docs[i] for i in picks]

    def act(state: AgentState) -> dict:
        found = search.invoke({"query": "town halls", "picks": state["plan"][0]})
        results = "Search results:\n" + "\n\n".join(d.page_content for d in found) + "\n"
        return {"messages": [*state["messages"], HumanMessage(results)], "plan": state["plan"]}

    def think(state: AgentState) -> dict:
        return {"messages": [*state["messages"], chat.invoke(state["messages"])], "plan": state["plan"][1:]}

    graph = StateGraph(AgentState)
    graph.add_node("act", act)
    graph.add_node("think", think)
    graph.add_edge(START, "act")
    graph.add_edge("act", "think")
    graph.add_conditional_edges("think", lambda s: "act" if s["plan"] else END)
    agent = graph.compile()

    def replies(opening: list, plan: list[list[int]]) -> list[AIMessage]:
        out = agent.invoke({"messages": opening, "plan": plan})["messages"]
        return [m for m in out if isinstance(m, AIMessage) and "spanq" in m.response_metadata]

    first = replies(
        [SystemMessage("You are a town clerk."), HumanMessage("Which town halls are painted red?")], [[0, 1], [2, 3]]
    )
    assert [stats(m)["spans"] for m in first] == [2, 4], "step 2 reads step 1's results and its own"
    assert [stats(m)["prepared_spans"] for m in first] == [2, 2], "step 2 prepares only its new documents"

    # Another conversation, opened differently, reads the same documents in other orders and other steps.
    second = replies(
        [SystemMessage("You help tourists plan trips."), HumanMessage("Hi! I am going north next week."),
         AIMessage("Lovely. How can I help?"), HumanMessage("Tell me about the town halls.")],
        [[3, 1], [0, 2]],
    )
    assert [stats(m)["spans"] for m in second] == [2, 4]
    assert [stats(m)["prepared_spans"] for m in second] == [0, 0], "every document was read before"
    # every document from the cache, but the last one's tail (under one block), which is read as context
    assert cache_read(second[1]) >= document_tokens(tiny_backend, docs) - 31
