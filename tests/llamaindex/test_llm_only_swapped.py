"""A LlamaIndex query engine with only the LLM swapped for `SpanQueryLLM` (LlamaIndex's own synthesizers):
the nodes the query retrieved are found in the prompt and sent as spans, and `response.metadata["spanq"]` says
what the calls did, for each built-in response mode. Two questions over the same four nodes in opposite orders:
the second computes no span."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest
from llama_index.core import QueryBundle, get_response_synthesizer
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore
from pydantic import BaseModel, Field

from spanq_integrations.llamaindex import SpanQueryLLM

pytestmark = pytest.mark.vllm


class FixedOrder(BaseRetriever):
    """Returns the index's nodes in the order given for each call (the nodes of a real retriever, reordered)."""

    def __init__(self, nodes: list[Any], orders: list[list[int]]):
        super().__init__()
        self._nodes, self._orders, self._calls = nodes, orders, 0

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        order = self._orders[self._calls % len(self._orders)]
        self._calls += 1
        return [NodeWithScore(node=self._nodes[i], score=1.0 - 0.1 * k) for k, i in enumerate(order)]


def nodes_of(index) -> list[Any]:
    return sorted(index.docstore.docs.values(), key=lambda n: n.metadata["town"])


def engine(llm: SpanQueryLLM, index, mode: str, orders: list[list[int]]) -> RetrieverQueryEngine:
    return RetrieverQueryEngine(
        FixedOrder(nodes_of(index), orders), get_response_synthesizer(llm=llm, response_mode=mode)
    )


def test_compact_reuses_the_nodes_in_a_new_order(tiny_backend, town_index):
    """The cache is emptied first (the town's nodes are every test's here), so the first question prepares each."""
    assert tiny_backend.engine.reset_prefix_cache(), "the engine's prefix cache could not be reset"
    llm = SpanQueryLLM(backend=tiny_backend, max_tokens=4, temperature=0.0)
    qe = engine(llm, town_index, "compact", [[0, 1, 2, 3], [3, 2, 1, 0]])
    first = qe.query("Which town hall is green?")
    second = qe.query("Which town hall is green?")
    for response in (first, second):
        assert response.metadata["spanq"]["spans"] == 4, response.metadata["spanq"]["fallback"]
        assert response.metadata["spanq"]["fallback"] is None
    assert first.metadata["spanq"]["prepared_spans"] == 4
    assert second.metadata["spanq"]["prepared_spans"] == 0, "every node came from the span cache"


def test_a_query_that_fails_leaves_nothing_behind_for_the_calls_after_it(tiny_backend, town_index):
    """LlamaIndex sends no QueryEndEvent for a query that raises: its record (its nodes, its calls) must still
    end with it — else every later call in this thread is matched against that query's nodes and its calls
    pile up there, without bound."""
    from spanq_integrations import BackendUnavailableError
    from spanq_integrations.llamaindex.run_nodes import current_record
    from tests.servers import free_port

    down = SpanQueryLLM(backend=f"spanq+http://127.0.0.1:{free_port()}", max_tokens=4, max_retries=0)

    def in_a_fresh_context():
        before = current_record()  # (a retrieval outside a query, of an earlier test in this thread, or None)
        for _ in range(3):
            with pytest.raises(BackendUnavailableError):
                engine(down, town_index, "compact", [[0, 1, 2, 3]]).query("Which town hall is green?")
        return before, current_record()

    before, after = contextvars.copy_context().run(in_a_fresh_context)
    assert after is before


def test_span_anchor_says_what_the_recovered_nodes_are_computed_after(tiny_backend, town_index):
    """`SpanQueryLLM(span_anchor=...)` as LangChain's: nodes cached under the default anchor are prepared again under
    "prefix" (their KV is computed after the prompt's own start, a different anchor), then reused under it. An LLM
    that ignored the setting would find them cached the second time (0 prepared)."""
    assert tiny_backend.engine.reset_prefix_cache(), "the engine's prefix cache could not be reset"
    default = SpanQueryLLM(backend=tiny_backend, max_tokens=4, temperature=0.0)
    prefix = SpanQueryLLM(backend=tiny_backend, max_tokens=4, temperature=0.0, span_anchor="prefix")
    orders = [[0, 1, 2, 3], [3, 2, 1, 0]]
    prepared = [
        engine(llm, town_index, "compact", [order]).query("Which town hall is green?").metadata["spanq"]["prepared_spans"]
        for llm, order in ((default, orders[0]), (prefix, orders[0]), (prefix, orders[1]))
    ]
    assert prepared == [4, 4, 0], prepared


@pytest.mark.parametrize("mode", ["refine", "tree_summarize", "accumulate"])
def test_every_built_in_response_mode_reuses_the_nodes_in_a_new_order(tiny_backend, town_index, mode):
    """What the README's LlamaIndex table claims for each mode: every node a span, and the same nodes retrieved
    in another order come from the span cache. The cache is emptied first, so the first question prepares each
    node (a mode that sent no spans, or a cache that missed on the reversed order, fails)."""
    assert tiny_backend.engine.reset_prefix_cache(), "the engine's prefix cache could not be reset"
    llm = SpanQueryLLM(backend=tiny_backend, max_tokens=4, temperature=0.0)
    qe = engine(llm, town_index, mode, [[0, 1, 2, 3], [3, 2, 1, 0]])
    first = qe.query("Which town hall is green?").metadata["spanq"]
    second = qe.query("Which town hall is green?").metadata["spanq"]
    for spanq in (first, second):
        # the shape a synthesizer's metadata has (`calls` a count, `per_call` a list): code reads either alike
        assert isinstance(spanq["calls"], int) and spanq["calls"] == len(spanq["per_call"]) >= 1, spanq
        assert spanq["spans"] >= 4, spanq
        assert all(c["fallback"] is None for c in spanq["per_call"]), spanq["per_call"]
    assert first["prepared_spans"] == 4, first
    assert second["prepared_spans"] == 0, f"{mode}: the reversed nodes were computed again: {second}"


@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_streaming_query_engine_sends_the_nodes_as_spans_and_says_so_when_the_stream_ends(tiny_backend, town_index,
                                                                                            how):
    """`streaming=True`: LlamaIndex calls the LLM only as the answer is read, after the query has ended (its
    QueryEndEvent came with the stream, not its text). The nodes must still go as spans, and the response's
    metadata say so once the stream is read (it once went as plain text, with no metadata and no reason)."""
    assert tiny_backend.engine.reset_prefix_cache(), "the engine's prefix cache could not be reset"
    llm = SpanQueryLLM(backend=tiny_backend, max_tokens=4, temperature=0.0)
    qe = RetrieverQueryEngine(FixedOrder(nodes_of(town_index), [[0, 1, 2, 3], [3, 2, 1, 0]]),
                              get_response_synthesizer(llm=llm, response_mode="compact", streaming=True))
    spanq = []
    for _ in range(2):
        if how == "sync":
            response = qe.query("Which town hall is green?")
            text = "".join(response.response_gen)
        else:
            async def read():
                response = await qe.aquery("Which town hall is green?")
                return response, "".join([piece async for piece in response.async_response_gen()])

            response, text = asyncio.run(read())
        assert text
        spanq.append(response.metadata["spanq"])
    assert [s["spans"] for s in spanq] == [4, 4] and spanq[0]["fallback"] is None, spanq
    assert [s["prepared_spans"] for s in spanq] == [4, 0], "the reversed nodes came from the span cache"


def test_simple_summarize_does_not_hold_the_nodes_verbatim_and_says_so(tiny_backend, town_index):
    """LlamaIndex 0.14's simple_summarize writes the Python repr of its list of chunks (escaped newlines): no node
    is in the prompt as it is, so the prompt goes unchanged and the metadata says why."""
    llm = SpanQueryLLM(backend=tiny_backend, max_tokens=4, temperature=0.0)
    response = engine(llm, town_index, "simple_summarize", [[0, 1, 2, 3]]).query("Which town hall is green?")
    spanq = response.metadata["spanq"]
    assert spanq["spans"] == 0 and "SpanQuerySynthesizer" in spanq["fallback"]


def test_a_prompt_that_does_not_hold_the_nodes_verbatim_goes_as_it_is_and_says_why(tiny_backend, town_index):
    from llama_index.core import PromptTemplate

    template = PromptTemplate("Context: {context_str} -- Question: {query_str}")  # nodes mid-line
    llm = SpanQueryLLM(backend=tiny_backend, max_tokens=4, temperature=0.0)
    synth = get_response_synthesizer(llm=llm, response_mode="compact", text_qa_template=template)
    response = RetrieverQueryEngine(FixedOrder(nodes_of(town_index), [[0, 1]]), synth).query("Green?")
    spanq = response.metadata["spanq"]
    assert spanq["spans"] == 0 and "line boundaries" in spanq["fallback"]
    assert "SpanQuerySynthesizer" in spanq["fallback"]


def test_recover_documents_off_and_outside_a_query_engine_nothing_changes(tiny_backend, town_index):
    """Run in a context of its own: a chat engine's retrieval (another test's, in this thread) stands for the LLM
    calls after it (`run_nodes`), and would rightly cut the plain prompt below."""
    contextvars.Context().run(recover_documents_off_and_outside_a_query_engine, tiny_backend, town_index)


def recover_documents_off_and_outside_a_query_engine(tiny_backend, town_index):
    off = SpanQueryLLM(backend=tiny_backend, max_tokens=4, temperature=0.0, recover_documents="off")
    response = engine(off, town_index, "compact", [[0, 1, 2, 3]]).query("Which town hall is green?")
    assert response.metadata["spanq"]["spans"] == 0
    # after the query: a prompt holding a node's text is not cut (no query, no nodes to look for)
    text = nodes_of(town_index)[0].get_content()
    plain = SpanQueryLLM(backend=tiny_backend, max_tokens=4, temperature=0.0).complete(f"Context:\n{text}\nWhich town?")
    assert plain.raw["spanq"]["prepared_spans"] == 0
    assert [c["extra"].get("spans", 0) for c in plain.raw["spanq"]["per_call"]] == [0], "no span sent"


def chat_spans(collector) -> list[dict[str, Any]]:
    """What each SpanQueryLLM chat call of a chat engine did (its response's raw usage)."""
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent

    return [e.response.raw["spanq"] for e in collector.events if isinstance(e, LLMChatEndEvent) and e.response]


@pytest.mark.parametrize("kind", ["context", "condense_plus_context", "condense_question"])
def test_a_chat_engine_sends_the_retrieved_nodes_as_spans(tiny_backend, town_index, events, kind):
    """#33 item 1: LlamaIndex's chat engines, only the LLM swapped. The two context engines retrieve outside any
    query (no QueryStartEvent), so until 2026-12-02 their nodes were never looked for and nothing was sent as
    spans: their first conversation prepared no span, and this test failed for them. `CondenseQuestionChatEngine`
    asks a query engine, which was covered already. A second conversation, opening differently and retrieving
    the same nodes in another order, prepares none."""
    from llama_index.core.chat_engine import (
        CondensePlusContextChatEngine,
        CondenseQuestionChatEngine,
        ContextChatEngine,
    )

    assert tiny_backend.engine.reset_prefix_cache(), "the engine's prefix cache could not be reset"
    llm = SpanQueryLLM(backend=tiny_backend, max_tokens=4, temperature=0.0)

    def make(order):
        retriever = FixedOrder(nodes_of(town_index), [order])
        if kind == "condense_question":  # a query engine behind it: the query's own record (no chat-only path)
            return CondenseQuestionChatEngine.from_defaults(
                query_engine=RetrieverQueryEngine(retriever, get_response_synthesizer(llm=llm)), llm=llm
            )
        chat_engine = ContextChatEngine if kind == "context" else CondensePlusContextChatEngine
        return chat_engine.from_defaults(retriever=retriever, llm=llm)

    make([0, 1, 2, 3]).chat("Which town hall is green?")
    make([3, 1, 0, 2]).chat("Good morning. Which town hall is dark red?")
    answered = chat_spans(events)
    assert answered[0]["prepared_spans"] == 4, answered[0]
    assert answered[-1]["prepared_spans"] == 0 and answered[-1]["cached_tokens"] > 0, answered[-1]


class TownSearch(BaseModel):
    query: str = Field(description="words to look for", max_length=20)  # bounded: the random model's call ends


def test_a_function_agent_sends_the_nodes_its_tool_retrieved_as_spans(compact_tiny, town_index, events):
    """#33 item 1: a `FunctionAgent`, only the LLM swapped, whose search tool runs a retriever and returns the
    nodes' text. The agent's workflow runs the tool and the LLM in different tasks, so the retrieval's record, kept
    in a context variable, never reached the LLM call after it: the nodes were sent as text (0 spans), and this test
    failed. The record now also belongs to the agent's run (its outermost open span). A second run, opening
    differently and retrieving the same nodes in another order, prepares none."""
    from llama_index.core.agent.workflow import FunctionAgent

    llm = SpanQueryLLM(backend=compact_tiny, max_tokens=64, temperature=0.0)
    # each run: the forced search call (no nodes yet), then the calls that read the tool's answer
    two_agent_runs_reuse_the_nodes(compact_tiny, town_index, events, lambda tool: FunctionAgent(
        tools=[tool], llm=llm, initial_tool_choice="search_towns", system_prompt=AGENT_PROMPT))  # fmt: skip


AGENT_PROMPT = "Search the town documents, then answer."


def two_agent_runs_reuse_the_nodes(backend, town_index, events, make_agent: Any) -> None:
    """Two runs of an agent (`make_agent(search_tool)`) whose search tool returns the index's nodes' text, the
    second opening differently and retrieving the same nodes in another order. In each run the call that chose
    the search (no nodes yet) sends no span and every later call the four nodes as spans; the first run prepares
    them, the second prepares none and reads them from the cache."""
    from llama_index.core.tools import FunctionTool

    assert backend.engine.reset_prefix_cache(), "the engine's prefix cache could not be reset"

    def ask(order: list[int], question: str) -> list[dict[str, Any]]:
        retriever = FixedOrder(nodes_of(town_index), [order])

        def search_towns(query: str) -> str:
            """Search the town documents."""
            return "\n\n".join(n.get_content() for n in retriever.retrieve(query))

        agent = make_agent(FunctionTool.from_defaults(search_towns, fn_schema=TownSearch))
        before = len(chat_spans(events))

        async def run():
            return await agent.run(question, max_iterations=4)

        asyncio.run(run())
        return chat_spans(events)[before:]

    first = ask([0, 1, 2, 3], "Which town hall is green?")
    second = ask([3, 1, 0, 2], "Good morning. Which town hall is dark red?")
    for calls in (first, second):
        spans = [sum(c["extra"].get("spans", 0) for c in call["per_call"]) for call in calls]
        assert len(spans) >= 2 and spans[0] == 0 and all(n == 4 for n in spans[1:]), spans
    assert first[1]["prepared_spans"] == 4, first[1]
    assert second[1]["prepared_spans"] == 0 and second[1]["cached_tokens"] > 0, second[1]

def search_first_parser():
    """ReAct's output parser, except that it reads the agent's first answer as a call of the search tool.

    ReAct has no forced tool choice (FunctionAgent's `initial_tool_choice`), the tiny random model writes no
    "Thought / Action / Action Input" text, spanq's constrained decoding is JSON only (no regex or grammar that
    could write ReAct's lines), and SmolLM2-135M at temperature 0 answers in prose instead of calling the tool.
    So the agent's own extension point stands in for the choice: the first answer (generated by the engine, its
    text the search's query) is the tool call; every later one is read by ReAct's own parser. Nothing the LLM
    receives changes: the prompts are the ReActAgent's, formatted by its `ReActChatFormatter`."""
    from llama_index.core.agent.react.output_parser import ReActOutputParser
    from llama_index.core.agent.react.types import ActionReasoningStep

    class SearchFirst(ReActOutputParser):
        answers = 0

        def parse(self, output: str, is_streaming: bool = False):
            self.answers += 1
            if self.answers == 1:
                query = " ".join(output.split())[:20] or "town halls"
                return ActionReasoningStep(thought="Search first.", action="search_towns",
                                           action_input={"query": query})  # fmt: skip
            return super().parse(output, is_streaming=is_streaming)

    return SearchFirst()


@pytest.mark.parametrize("streaming", [True, False], ids=["astream_chat", "achat"])
def test_a_react_agent_sends_the_nodes_its_tool_retrieved_as_spans(compact_tiny, town_index, events, streaming):
    """#33 item 1: a `ReActAgent`, only the LLM swapped, whose search tool runs a retriever and returns the nodes'
    text. ReAct writes the tool's answer into a user message as "Observation: <first node>\\n\\n<second node>…":
    the first node starts after "Observation:" on its line, which the node finder takes as a line boundary (a
    group of documents may start after a colon), so every node is a span in the agent's calls after the
    observation; the retrieval, in the tool's task, reaches them through the agent run's record. A second run,
    opening differently and retrieving the same nodes in another order, prepares none. Both of the agent's LLM
    paths: streaming (its default) and not. Measured 2026-12-03, it passed with no change to spanq; with
    `recover_documents="off"` the call after the observation sends 0 spans and it fails (`[0, 0]`)."""
    from llama_index.core.agent.workflow import ReActAgent

    llm = SpanQueryLLM(backend=compact_tiny, max_tokens=8, temperature=0.0)
    two_agent_runs_reuse_the_nodes(compact_tiny, town_index, events, lambda tool: ReActAgent(
        tools=[tool], llm=llm, output_parser=search_first_parser(), streaming=streaming, system_prompt=AGENT_PROMPT))  # fmt: skip
