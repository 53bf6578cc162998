"""SpanQueryTreeSynthesizer: a k-ary tree of calls over the nodes, each leaf reading k nodes as spans."""

from __future__ import annotations

import pytest
from llama_index.core.schema import NodeWithScore, TextNode

from spanq_integrations import ContextLengthError, QueryValidationError
from spanq_integrations.llamaindex import SpanQueryTreeSynthesizer

pytestmark = pytest.mark.vllm


def nodes_of(count: int, words: int = 12) -> list[NodeWithScore]:
    return [
        NodeWithScore(node=TextNode(text=f"Document {i}: " + f"fact{i} " * words, id_=f"node-{i}"), score=1.0)
        for i in range(count)
    ]


def paths(response) -> list[str]:
    return sorted(c["path"] for c in response.metadata["spanq"]["per_call"])


def test_pairwise_tree_over_five_nodes(span_llm):
    response = SpanQueryTreeSynthesizer(llm=span_llm).synthesize("q?", nodes_of(5))
    usage = response.metadata["spanq"]
    # 5 nodes, k=2: (0,1) (2,3) 4 → (01,23) 4 → root over 2: 2 + 1 + 1 = 4 calls.
    assert usage["calls"] == 4
    assert paths(response) == sorted(
        [
            "$",
            "$.g.input.cross[1].plus[0]",
            "$.g.input.cross[1].plus[0].g.input.cross[1].plus[0]",
            "$.g.input.cross[1].plus[0].g.input.cross[1].plus[1]",
        ]
    )
    assert all(c["extra"]["spans"] <= 2 for c in usage["per_call"])  # no call reads more than k inputs
    assert [n.node.node_id for n in response.source_nodes] == [f"node-{i}" for i in range(5)]


def test_k_nodes_or_fewer_take_one_call(span_llm):
    response = SpanQueryTreeSynthesizer(llm=span_llm, k=3).synthesize("q?", nodes_of(3))
    assert paths(response) == ["$"]


def test_the_leaves_reuse_cached_node_spans(span_llm):
    synthesizer = SpanQueryTreeSynthesizer(llm=span_llm, k=2)
    nodes = nodes_of(4, words=40)
    synthesizer.synthesize("first question?", nodes)
    again = synthesizer.synthesize("second question?", nodes)
    leaves = [c for c in again.metadata["spanq"]["per_call"] if c["path"] != "$"]
    assert len(leaves) == 2 and all(c["prepared_spans"] == 0 for c in leaves)
    assert all(c["cached_tokens"] >= 64 for c in leaves)


def test_streaming_streams_the_root_answer(span_llm):
    response = SpanQueryTreeSynthesizer(llm=span_llm, streaming=True).synthesize("q?", nodes_of(4))
    text = "".join(response.response_gen)
    assert text
    root = next(c for c in response.metadata["spanq"]["per_call"] if c["path"] == "$")
    assert root["generated_tokens"] == 6


def test_intermediate_instruction_and_bad_k(span_llm):
    synthesizer = SpanQueryTreeSynthesizer(llm=span_llm, intermediate_instruction="Summarize.")
    assert synthesizer.synthesize("q?", nodes_of(3)).metadata["spanq"]["calls"] == 2
    for k in (1, 0, True, 2.5):
        with pytest.raises(QueryValidationError, match="k must be an integer >= 2"):
            SpanQueryTreeSynthesizer(llm=span_llm, k=k)


def test_an_over_long_node_is_explained(span_llm):
    nodes = nodes_of(3)
    nodes[1] = NodeWithScore(node=TextNode(text="word " * 2500, id_="huge"), score=1.0)
    with pytest.raises(ContextLengthError, match="one call of the tree does not fit.*lower k"):
        SpanQueryTreeSynthesizer(llm=span_llm).synthesize("q?", nodes)


def test_combined_in_code_the_tree_is_its_leaves_and_the_answer_their_union(span_llm):
    from spanq_integrations.query.ir import Assistant, Combine
    from spanq_integrations.runtime.reducers import ExtractReducer

    synthesizer = SpanQueryTreeSynthesizer(llm=span_llm, k=2, reducer="extract")
    nodes = nodes_of(5)
    response = synthesizer.synthesize("Which facts are mentioned?", nodes)
    per_call = response.metadata["spanq"]["per_call"]
    assert paths(response) == [f"$.combine.input.plus[{i}]" for i in range(3)]  # (0,1) (2,3) (4): no root call
    assert all(c["extra"]["spans"] <= 2 for c in per_call)
    # the same query run directly (greedy, so the same answers): the answer is the union of the leaves' items
    query = synthesizer.build_query("Which facts are mentioned?", synthesizer.node_fragments(nodes))
    run = span_llm.run_query(query, **synthesizer._run_options())
    assert isinstance(run.tree, Assistant) and isinstance(run.tree.source, Combine)
    leaves = [a.text for a in run.tree.source.input.children]
    union: list[str] = []
    for text in leaves:
        union += [item for item in ExtractReducer().parse(text, path="$") if item.casefold() not in
                  {u.casefold() for u in union}]  # fmt: skip
    assert response.response == run.answer == "\n".join(union)


def test_a_reducer_that_cannot_combine_in_code_is_refused(span_llm):
    with pytest.raises(QueryValidationError, match="merge reducer needs a model"):
        SpanQueryTreeSynthesizer(llm=span_llm, reducer="merge")
