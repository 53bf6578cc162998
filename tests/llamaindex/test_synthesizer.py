"""SpanQuerySynthesizer in LlamaIndex query engines: nodes as spans, span-cache hits, sources, streaming, errors.

The tiny random model's answers are gibberish: these tests check the call structure, the cache and what the
response carries, not what it says.
"""

from __future__ import annotations

import pytest
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode

from spanq_integrations import ContextLengthError, Plus
from spanq_integrations.llamaindex import NoNodesError, SpanQueryLLM, SpanQuerySynthesizer

pytestmark = pytest.mark.vllm

QUESTION_HARBOR = "What colour is the town hall of the fishing town Lindale Harbor?"
QUESTION_RIVER = "What colour is the town hall of Pell Crossing by the river bridge?"


def nodes_of(*texts: str) -> list[NodeWithScore]:
    return [NodeWithScore(node=TextNode(text=t, id_=f"node-{i}"), score=1.0) for i, t in enumerate(texts)]


def span_end(tiny_backend, synthesizer, question, nodes) -> int:
    """Where the last node's span ends in the prompt of this question over these nodes."""
    lowered = tiny_backend.engine.lower(synthesizer.build_query(question, synthesizer.node_fragments(nodes)))
    return lowered.table.spans[-1][1]


def test_query_engine_reuses_the_nodes_across_questions_and_orders(town_index, span_llm, tiny_backend):
    synthesizer = SpanQuerySynthesizer(llm=span_llm)
    engine = town_index.as_query_engine(llm=span_llm, response_synthesizer=synthesizer, similarity_top_k=4)

    first = engine.query(QUESTION_HARBOR)
    second = engine.query(QUESTION_RIVER)

    ids = [[n.node.node_id for n in r.source_nodes] for r in (first, second)]
    assert sorted(ids[0]) == sorted(ids[1]) and len(ids[0]) == 4  # the same nodes…
    assert ids[0] != ids[1]  # …retrieved in another order
    assert first.source_nodes[0].node.metadata["town"] == "harbor"
    assert second.source_nodes[0].node.metadata["town"] == "river"

    usage = second.metadata["spanq"]
    assert usage["calls"] == 1
    assert usage["prepared_spans"] == 0  # every node's span was already in the cache
    assert usage["cached_tokens"] >= span_end(tiny_backend, synthesizer, QUESTION_RIVER, second.source_nodes)
    assert {"padded_tokens", "ttft_s", "prompt_tokens", "per_call"} <= set(usage)
    assert usage["per_call"][0]["extra"]["spans"] == 4
    for response in (first, second):  # LlamaIndex's own metadata (node id -> node metadata) is kept
        assert all(response.metadata[n.node.node_id] == n.node.metadata for n in response.source_nodes)


def test_recompute_set_on_the_llm_reaches_the_synthesizers_call(town_index, tiny_backend):
    redo = SpanQueryLLM(backend=tiny_backend, max_tokens=6, temperature=0.0, recompute=0.5)
    synthesizer = SpanQuerySynthesizer(llm=redo)
    engine = town_index.as_query_engine(llm=redo, response_synthesizer=synthesizer, similarity_top_k=4)
    (call,) = engine.query(QUESTION_HARBOR).metadata["spanq"]["per_call"]
    lowered = tiny_backend.engine.lower(synthesizer.build_query(QUESTION_HARBOR, [f"x{i}" for i in range(4)]))
    assert call["extra"]["recomputed_tokens"] > 0 and lowered.table.spans
    assert synthesizer.build_query("q", ["a"]).recompute == 0.5


def test_the_llms_span_anchor_and_recompute_reach_the_synthesizer_and_the_judge():
    """#32 item 9: span settings set on the LLM reach every adapter that sends spans. The synthesizer's own
    `span_anchor` wins; when it names none the LLM's applies (it was the backend's default, whatever the LLM
    said); the pairwise judge's candidates carried no anchor at all. No call is made: the queries are built."""
    from spanq_integrations.llamaindex import SpanQueryPairwiseEvaluator
    from spanq_integrations.query.ir import walk

    def anchors(query):
        return [n.anchor for _, n in walk(query) if isinstance(n, Plus)]

    llm = SpanQueryLLM(backend="http://127.0.0.1:9/v1", span_anchor="prefix", recompute="first")
    built = SpanQuerySynthesizer(llm=llm).build_query("q", ["a", "b"])
    assert anchors(built) == ["prefix"] and built.recompute == "first"
    assert anchors(SpanQuerySynthesizer(llm=llm, span_anchor="system").build_query("q", ["a", "b"])) == ["system"]
    judged = SpanQueryPairwiseEvaluator(llm=llm).build_query("q", ["a", "b"])
    assert anchors(judged) == ["prefix"] and judged.recompute == "first"


def test_every_node_is_its_own_span_with_its_id(span_llm):
    synthesizer = SpanQuerySynthesizer(llm=span_llm, system_prompt="S", query_template="Q: {query_str}")
    nodes = nodes_of("alpha", "  ", "gamma")
    query = synthesizer.build_query("why?", synthesizer.node_fragments(nodes))
    system_msg, documents, question = query.input.children
    assert isinstance(documents, Plus)
    assert [(f.id, f.text) for f in documents.children] == [("node-0", "alpha"), ("node-2", "gamma")]
    assert (system_msg.text, question.text, query.max_tokens) == ("S", "Q: why?", 6)

    synthesizer.update_prompts({"system_prompt": type(synthesizer.get_prompts()["system_prompt"])("T")})
    assert synthesizer.build_query("why?", ["x"]).input.children[0].text == "T"


def test_retriever_query_engine_and_streaming(town_index, span_llm):
    synthesizer = SpanQuerySynthesizer(llm=span_llm, streaming=True)
    engine = RetrieverQueryEngine(
        retriever=town_index.as_retriever(similarity_top_k=3), response_synthesizer=synthesizer
    )
    response = engine.query(QUESTION_HARBOR)
    assert len(response.source_nodes) == 3
    assert "spanq" not in response.metadata  # known once the stream is read
    pieces = list(response.response_gen)
    assert len(pieces) > 1
    assert response.metadata["spanq"]["generated_tokens"] == 6
    assert response.metadata["spanq"]["cached_tokens"] > 0

    plain = SpanQuerySynthesizer(llm=span_llm).synthesize(QUESTION_HARBOR, response.source_nodes)
    assert "".join(pieces) == plain.response


async def test_async_query_engine_and_async_streaming(town_index, span_llm):
    engine = town_index.as_query_engine(
        llm=span_llm, response_synthesizer=SpanQuerySynthesizer(llm=span_llm), similarity_top_k=2
    )
    response = await engine.aquery(QUESTION_RIVER)
    assert response.response and len(response.source_nodes) == 2
    assert response.metadata["spanq"]["calls"] == 1

    streaming = SpanQuerySynthesizer(llm=span_llm, streaming=True)
    streamed = await streaming.asynthesize(QUESTION_RIVER, response.source_nodes)
    assert "".join([piece async for piece in streamed.response_gen]) == response.response
    assert streamed.metadata["spanq"]["prepared_spans"] == 0


def test_synthesis_events(span_llm, events):
    SpanQuerySynthesizer(llm=span_llm).synthesize("q?", nodes_of("one", "two"))
    assert events.names() == ["SynthesizeStartEvent", "SynthesizeEndEvent"]
    assert events.events[-1].response.metadata["spanq"]["calls"] == 1


def test_text_chunks_entry_point(span_llm):
    synthesizer = SpanQuerySynthesizer(llm=span_llm)
    answer = synthesizer.get_response("q?", ["one", "two"])
    assert isinstance(answer, str) and answer
    assert synthesizer.get_response("q?", [" "]) == "Empty Response"


# --------------------------------------------------------------------------------------------- bad input


def test_no_nodes_answers_empty_response_without_a_call(span_llm, events):
    response = SpanQuerySynthesizer(llm=span_llm).synthesize("q?", [])
    assert response.response == "Empty Response"
    assert response.metadata["spanq"] == {"calls": 0, "no_nodes": True}
    assert "LLMChatStartEvent" not in events.names()

    streamed = SpanQuerySynthesizer(llm=span_llm, streaming=True).synthesize("q?", nodes_of(" "))
    assert "".join(streamed.response_gen) == "Empty Response"

    with pytest.raises(NoNodesError, match="no nodes to answer from"):
        SpanQuerySynthesizer(llm=span_llm, raise_on_empty=True).synthesize("q?", [])


def test_a_node_longer_than_the_context_is_named(span_llm):
    nodes = nodes_of("short", "word " * 2500, "short too")
    with pytest.raises(ContextLengthError, match=r"node 'node-1' is too long .*SentenceSplitter"):
        SpanQuerySynthesizer(llm=span_llm).synthesize("q?", nodes)


def test_nodes_that_only_together_overflow_point_to_the_tree(span_llm):
    nodes = nodes_of(*[f"Document {i}: " + "word " * 600 for i in range(4)])
    with pytest.raises(ContextLengthError, match=r"4 retrieved nodes do not fit .*SpanQueryTreeSynthesizer"):
        SpanQuerySynthesizer(llm=span_llm).synthesize("q?", nodes)


def test_streaming_errors_surface_while_reading(span_llm):
    response = SpanQuerySynthesizer(llm=span_llm, streaming=True).synthesize("q?", nodes_of("word " * 2500))
    with pytest.raises(ContextLengthError, match="node 'node-0'"):
        list(response.response_gen)


def test_a_synthesizer_needs_a_span_query_llm():
    from llama_index.core.llms import MockLLM

    with pytest.raises(TypeError, match="need a SpanQueryLLM"):
        SpanQuerySynthesizer(llm=MockLLM())
    assert isinstance(SpanQuerySynthesizer()._llm, SpanQueryLLM)  # the embedded default, started lazily


@pytest.mark.parametrize("wrong", [None, "a text", ["a", "b"], TextNode(text="one node")])
def test_nodes_of_the_wrong_kind_are_spanqs_error_naming_the_argument(wrong):
    """None, a string, strings, or one node (not a list) failed with Python's own TypeError or AttributeError
    ('str' object has no attribute 'node'); a list of bare nodes is read as a retriever's output."""
    from spanq_integrations import SpanQueryError

    synthesizer = SpanQuerySynthesizer(llm=SpanQueryLLM(backend="http://127.0.0.1:9/v1"))
    with pytest.raises(TypeError, match=r"synthesize\(nodes(\[0\])?\): takes") as caught:
        synthesizer.synthesize("q?", wrong)
    assert isinstance(caught.value, SpanQueryError)


def test_bare_nodes_are_read_as_a_retrievers_output(span_llm):
    response = SpanQuerySynthesizer(llm=span_llm).synthesize("q?", [TextNode(text="The mill is red.", id_="n1")])
    assert response.metadata["spanq"]["calls"] == 1 and [n.node.node_id for n in response.source_nodes] == ["n1"]
