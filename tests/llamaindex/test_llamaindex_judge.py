"""SpanQueryPairwiseEvaluator: one call with the candidates as an order-free plus; matching the copy back."""

from __future__ import annotations

import pytest

from spanq_integrations import Plus, QueryValidationError
from spanq_integrations.llamaindex import SpanQueryLLM, SpanQueryPairwiseEvaluator, copied_candidate

PARIS = "The capital of France is Paris."
LYON = "The capital of France is Lyon."


# --------------------------------------------------------------------------------------------- no engine


def test_the_copy_is_matched_to_the_candidate_it_repeats():
    assert copied_candidate("The capital of France is Paris.", [LYON, PARIS]) == (1, [5 / 6, 1.0])
    assert copied_candidate("Paris, I think: the capital of France is Paris", [PARIS, LYON])[0] == 0
    assert copied_candidate("the capital of france is", [PARIS, LYON])[0] is None  # both equally
    assert copied_candidate("Answer B", [PARIS, LYON]) == (None, [0.0, 0.0])
    assert copied_candidate("", [PARIS, LYON])[0] is None
    # one candidate inside the other: the output copies all of the short one, a part of the long one
    assert copied_candidate("Paris", ["Paris", "Paris is the capital of France."]) == (0, [1.0, 1.0])
    assert copied_candidate("The answer is 4.", ["4", "The answer is 4."])[0] == 1
    assert copied_candidate("4", ["The answer is 4.", "4"])[0] == 1


def test_the_prompt_does_not_depend_on_the_order_of_the_candidates():
    judge = SpanQueryPairwiseEvaluator(llm=SpanQueryLLM())
    forward = judge.build_query("Capital of France?", [PARIS, LYON], reference="Paris")
    assert forward == judge.build_query("Capital of France?", [LYON, PARIS], reference="Paris")
    candidates = forward.input.children[2]
    assert isinstance(candidates, Plus) and sorted(c.text for c in candidates.children) == sorted(
        [PARIS, LYON]
    )
    assert "Reference:\nParis" in forward.input.children[1].text
    assert (forward.temperature, forward.max_tokens) == (0.0, 64)


def test_bad_arguments():
    judge = SpanQueryPairwiseEvaluator(llm=SpanQueryLLM())
    with pytest.raises(QueryValidationError, match="at least two candidates"):
        judge.build_query("q", [PARIS])
    with pytest.raises(QueryValidationError, match="second_response must be provided"):
        judge.evaluate(query="q", response=PARIS)
    with pytest.raises(QueryValidationError, match="k must be an integer >= 2"):
        SpanQueryPairwiseEvaluator(llm=SpanQueryLLM(), k=1)
    # "combine" takes judge()'s words, meaning the same (#32 item 3): "auto" combines in code, as `select` can.
    with pytest.raises(QueryValidationError, match="unknown combine mode 'tree': one of auto, code, model"):
        SpanQueryPairwiseEvaluator(llm=SpanQueryLLM(), combine="tree")
    assert SpanQueryPairwiseEvaluator(llm=SpanQueryLLM(), combine="auto")._combine == "code"


# --------------------------------------------------------------------------------------------- tiny engine


@pytest.mark.vllm
def test_one_call_and_swapping_mirrors_the_verdict(span_llm):
    judge = SpanQueryPairwiseEvaluator(llm=span_llm, max_tokens=8)
    forward = judge.evaluate(query="Capital of France?", response=PARIS, second_response=LYON)
    swapped = judge.evaluate(query="Capital of France?", response=LYON, second_response=PARIS)
    assert forward.usage["calls"] == swapped.usage["calls"] == 1
    assert forward.feedback == swapped.feedback  # the same prompt, whatever the order given
    assert forward.overlaps == swapped.overlaps[::-1]
    if forward.choice is not None:
        assert swapped.choice == 1 - forward.choice and forward.score == 1 - swapped.score
    assert swapped.usage["prepared_spans"] == 0  # the candidates' spans were cached by the first call
    assert forward.pairwise_source == "order_free"


@pytest.mark.vllm
async def test_best_of_many_is_a_tree_of_pairwise_judges(span_llm):
    judge = SpanQueryPairwiseEvaluator(llm=span_llm, max_tokens=8)
    candidates = [f"Answer number {i} says the capital is city {i}." for i in range(5)]
    result = await judge.aselect("Capital of France?", candidates)
    assert result.usage["calls"] == 4  # 5 candidates, k=2
    assert all(c["extra"]["spans"] <= 2 for c in result.usage["per_call"])
    assert len(result.overlaps) == 5


@pytest.mark.vllm
async def test_best_of_many_combined_in_code_rates_candidates_at_the_leaves(span_llm):
    judge = SpanQueryPairwiseEvaluator(llm=span_llm, max_tokens=16, combine="code")
    candidates = [f"Answer number {i} says the capital is city {i}." for i in range(5)]
    result = await judge.aselect("Capital of France?", candidates)
    per_call = result.usage["per_call"]
    assert result.usage["calls"] == len(per_call) == 3  # 5 candidates, k=2: three leaves, no call above them
    assert all(c["extra"]["spans"] <= 2 for c in per_call)
    assert result.invalid_result == (result.choice is None)
    if result.choice is not None:  # the tiny random model may give no readable score
        assert result.response == f"[{result.choice}]"
    with pytest.raises(QueryValidationError, match="unknown combine mode"):
        SpanQueryPairwiseEvaluator(llm=span_llm, combine="vote")


async def test_best_of_many_combined_in_code_does_not_depend_on_the_order_given():
    """Every candidate rated alike: a tie goes to the lowest label, and labels were given in the caller's order, so
    the winner was whichever candidate came first (the class says the verdict never depends on it)."""
    import re

    from spanq_integrations.backends.protocol import Backend, BackendCapabilities, CallMetrics, Completion
    from spanq_integrations.query.flatten import to_chat_messages

    class RatesAllAlike(Backend):
        capabilities = BackendCapabilities(name="alike")

        async def generate(self, call, *, path="$", on_token=None):
            labels = re.findall(r"^\[(\d+)\] ", to_chat_messages(call.input)[-1]["content"], re.MULTILINE)
            text = "\n".join(f"[{label}] 7" for label in labels)[1:]  # (the instruction ends on "[")
            return Completion(texts=[text], metrics=CallMetrics(path=path, model="alike"))

    judge = SpanQueryPairwiseEvaluator(llm=SpanQueryLLM(backend=RatesAllAlike()), combine="code")
    candidates = [f"Answer {i}: the capital is city {i}." for i in range(5)]
    forward = await judge.aselect("Capital of France?", candidates)
    backward = await judge.aselect("Capital of France?", candidates[::-1])
    assert forward.choice is not None and backward.choice is not None
    assert candidates[forward.choice] == candidates[::-1][backward.choice]
    assert forward.response == f"[{forward.choice}]"  # the label of the candidate as the caller passed it
