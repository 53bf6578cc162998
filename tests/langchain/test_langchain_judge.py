"""Judge ensembles: N candidates and the judge as one span query, tree reduction, and a LangGraph map-reduce."""

from __future__ import annotations

import pytest

from spanq_integrations.langchain import ChatSpanQuery, JudgeEnsemble, JudgeVerdict
from tests.examples import load_example

pytestmark = pytest.mark.vllm

QUESTION = "Which town can only be reached by ferry?"
DOCUMENTS = [
    "Lindale Harbor is a fishing town; the ferry to the islands leaves from pier three twice a day.",
    "Brackwell is an orchard village; its cider press runs from September to November.",
]




@pytest.fixture
def llm(tiny_backend):
    return ChatSpanQuery(backend=tiny_backend, max_tokens=6)


def test_the_ensemble_returns_a_verdict_and_the_outputs_it_reused(llm):
    verdict = JudgeEnsemble(llm=llm, n=3).invoke({"question": QUESTION, "documents": DOCUMENTS})
    assert isinstance(verdict, JudgeVerdict) and isinstance(verdict.verdict, str)
    assert len(verdict.candidates) == 3
    assert sorted(verdict.reused_outputs) == sorted(
        verdict.candidates
    )  # the judge read every candidate as a span
    assert len(verdict.calls) == 4  # three generators, one judge
    root = next(c for c in verdict.calls if c.path == "$")
    assert root.extra["spans"] == len(set(verdict.candidates))
    generators = [c for c in verdict.calls if c.path != "$"]
    assert all(c.extra["spans"] == 2 for c in generators)  # the documents, as spans of every generator
    assert verdict.selection is None or 0 <= verdict.selection.index < 3
    assert verdict.levels[-1].calls[0].path == "$"


def test_tree_reduction_judges_k_candidates_at_a_time(llm):
    verdict = JudgeEnsemble(llm=llm, n=4, k=2, combine="model").invoke(QUESTION)
    assert len(verdict.candidates) == 4 and verdict.combine == "model"
    assert len(verdict.calls) == 4 + 2 + 1  # generators, two intermediate judges, the root judge
    assert len(verdict.reused_outputs) == 4 + 2  # candidates read by the judges, the judges read by the root
    assert set(verdict.candidates) <= set(verdict.reused_outputs)


def test_tree_reduction_combined_in_code_rates_candidates_at_the_leaves_only(llm):
    verdict = JudgeEnsemble(llm=llm, n=4, k=2, combine="code").invoke(QUESTION)
    assert verdict.combine == "code"
    assert len(verdict.calls) == 4 + 2  # generators and two scoring leaves: no call above them
    assert sorted(verdict.reused_outputs) == sorted(verdict.candidates)  # only candidates are read as spans
    leaves, (root,) = (level.calls for level in verdict.levels)
    assert root.kind == "code" and [c.kind for c in leaves] == ["model", "model"]
    scored = {label: score for leaf in leaves if leaf.parse_error is None for label, score in leaf.parsed.items()}
    if scored:  # the tiny random model may write no score at all; then there is no verdict
        best = max(scored.values())
        assert verdict.selection is not None
        assert verdict.selection.index == min(label for label, score in scored.items() if score == best)
        assert verdict.selection.text == verdict.candidates[verdict.selection.index]
    else:
        assert verdict.parsed is None and verdict.parse_error


async def test_judging_given_candidates_again_reads_them_from_the_span_cache(llm, tiny_backend):
    candidates = [
        "The ferry leaves from pier three of Lindale Harbor, twice a day, for the islands in the north.",
        "Only Lindale Harbor: the islands' ferry leaves from its pier three in the morning and the evening.",
        "Brackwell, by the orchard road; the cider press there runs from September until late November.",
    ]
    judge = JudgeEnsemble(llm=llm, reducer="extract")  # `select` labels candidates by position: [0], [1], …
    await judge.ainvoke({"question": QUESTION, "candidates": candidates})
    again = await judge.ainvoke({"question": QUESTION, "candidates": candidates[::-1]})
    assert again.candidates == candidates[::-1] and again.reused_outputs == []
    tokens = sum(len(tiny_backend.engine.tokenizer.encode(c, add_special_tokens=False)) for c in candidates)
    assert again.judge_cached_tokens >= tokens
    assert again.levels[-1].calls[0].metrics.prepared_spans == 0


async def test_judges_of_a_tree_combined_in_code_count_what_they_read_from_the_cache(llm, tiny_backend):
    """`judge_cached_tokens` was the root judge's alone: always 0 at the default, where a combine in code (no call)
    is the root over the leaf judges."""
    candidates = [f"Record {i}: the ferry to isle {i} leaves from pier {i} of Lindale Harbor." for i in range(4)]
    judge = JudgeEnsemble(llm=llm, reducer="extract", k=2)
    await judge.ainvoke({"question": QUESTION, "candidates": candidates})
    again = await judge.ainvoke({"question": QUESTION, "candidates": candidates})
    assert again.combine == "code" and len(again.levels[0].calls) == 2
    tokens = sum(len(tiny_backend.engine.tokenizer.encode(c, add_special_tokens=False)) for c in candidates)
    assert again.judge_cached_tokens >= tokens
    assert again.judge_cached_tokens == sum(c.metrics.cached_tokens for c in again.levels[0].calls)


def test_the_langgraph_map_reduce_example(llm):
    state = load_example("examples/judge/langchain_judge_graph.py").run(llm, n=3, k=2)
    verdict = state["verdict"]
    assert len(state["candidates"]) == 3 and verdict.candidates == state["candidates"]
    assert len(verdict.calls) == 2  # the judge of two candidates, then the root over it and the third


def test_the_judge_example(llm):
    verdict = load_example("examples/judge/langchain_judge.py").run(llm, n=2, k=None)
    assert len(verdict.candidates) == 2 and len(verdict.calls) == 3


def test_strict_raises_when_the_judge_names_no_candidate(llm):
    from spanq_integrations import ReducerParseError

    candidates = ["The ferry leaves from pier three.", "The cider press runs in autumn."]
    lenient = JudgeEnsemble(llm=llm).invoke({"question": QUESTION, "candidates": candidates})
    if lenient.selection is not None:
        pytest.skip("this model's judge named a candidate")
    assert lenient.parse_error and lenient.verdict == lenient.levels[-1].calls[0].output
    # the reason is the root's own (what the judge answered, what the reducer wanted), not a generic line
    assert lenient.parse_error == lenient.levels[-1].calls[0].parse_error
    with pytest.raises(ReducerParseError, match="select"):
        JudgeEnsemble(llm=llm, strict=True).invoke({"question": QUESTION, "candidates": candidates})


def test_the_models_span_anchor_and_recompute_reach_the_ensembles_generators():
    """#32 item 9: the documents the candidates are generated from are spans under the model's `span_anchor`, and
    the generations recompute as the model says (both were the backend's defaults, whatever the model said)."""
    from spanq_integrations import Plus
    from spanq_integrations.query.ir import walk

    model = ChatSpanQuery(backend="http://127.0.0.1:9/v1", span_anchor="prefix", recompute="first")
    generators = JudgeEnsemble(llm=model, n=2).generators("q", ["doc one", "doc two"])
    assert [[n.anchor for _, n in walk(g) if isinstance(n, Plus)] for g in generators] == [["prefix"], ["prefix"]]
    assert [g.recompute for g in generators] == ["first", "first"]
