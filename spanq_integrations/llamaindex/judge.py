"""`SpanQueryPairwiseEvaluator`: an LLM judge that reads the candidates as one order-free `plus` of spans.

LlamaIndex's `PairwiseComparisonEvaluator` labels the answers "A" and "B", and, to cancel the judge's position
bias, asks twice with the order swapped (two calls, each generating an explanation and a verdict); when the two
verdicts disagree the result is inconclusive. This judge asks once:

    generate(cross(system(judge), user(question [+ reference]), plus(candidate₁, candidate₂, …), user(copy it)))

The candidates carry no labels, so nothing in a candidate's span depends on where it sits; the judge answers
by copying the best candidate, and the copy is matched back to a candidate by the words it shares with each.
Because a `plus` is commutative, the candidates are laid out in a canonical order (by a hash of their text):
the verdict depends on the set of candidates, never on the order the caller passed them, so swapping the two
answers mirrors the verdict by construction — what the second, swapped call checks for. On a span-aware
backend a candidate that is judged again (in another pair, at another position) reuses its cached KV.

More than `k` candidates (`aselect`): the optimizer's tree reduction judges k at a time, each inner judge
copying its pick up to the next level, so every call reads at most k candidates (`combine="model"`, the
default). With `combine="code"` the candidates are shown with labels and each leaf judge rates the k it reads
from 0 to 10; the highest score wins, chosen in code (spanq's `select` reducer scored), so no judge above the
leaves can lose the winner.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from difflib import SequenceMatcher
from typing import Any, Literal

from llama_index.core.bridge.pydantic import Field
from llama_index.core.evaluation.base import BaseEvaluator, EvaluationResult
from llama_index.core.prompts import PromptTemplate
from llama_index.core.prompts.mixin import PromptDictType

from spanq_integrations.llamaindex.llm import SpanQueryLLM
from spanq_integrations.llamaindex.synthesizer import span_query_llm
from spanq_integrations.llamaindex.usage import usage_of
from spanq_integrations.query.errors import QueryValidationError, check_fan_in
from spanq_integrations.query.ir import Generate, cross, fragment, plus, system, user

__all__ = [
    "DEFAULT_JUDGE_INSTRUCTION",
    "DEFAULT_JUDGE_SYSTEM_PROMPT",
    "SpanJudgeResult",
    "SpanQueryPairwiseEvaluator",
    "copied_candidate",
]

DEFAULT_JUDGE_SYSTEM_PROMPT = (
    "You are an impartial judge. The user asks a question; candidate answers to it follow, in no particular "
    "order. Pick the candidate that answers the question best: correct, relevant and helpful. Do not let the "
    "length of an answer influence you. Reply with the text of the best candidate, copied word for word, and "
    "nothing else."
)
DEFAULT_JUDGE_INSTRUCTION = "Copy the best answer word for word."
ORDER_FREE_SOURCE = "order_free"  # EvaluationResult.pairwise_source of this judge's verdicts

_WORD = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def copied_candidate(
    output: str, candidates: Sequence[str], min_overlap: float = 0.5
) -> tuple[int | None, list[float]]:
    """Which candidate the judge's `output` copies, and each candidate's overlap with it.

    A candidate's overlap is the share of the output's words it contains in the same order (longest matching
    blocks). The one with the largest overlap wins, if that is at least `min_overlap`; between candidates of the
    same overlap, the one more of whose own words the output copies (the output "Paris" copies all of "Paris"
    and a sixth of "Paris is the capital of France."). Where that too is the same, or the output copies
    nothing, the index is None (a tie).
    """
    out = _words(output)
    overlaps, scores = [], []
    for candidate in candidates:
        words = _words(candidate)
        matcher = SequenceMatcher(None, out, words, autojunk=False)
        matched = sum(block.size for block in matcher.get_matching_blocks())
        overlaps.append(matched / len(out) if out else 0.0)
        scores.append((overlaps[-1], matched / len(words) if words else 0.0))
    best = max(range(len(scores)), key=scores.__getitem__, default=None)
    if best is None or overlaps[best] < min_overlap or scores.count(scores[best]) > 1:
        return None, overlaps
    return best, overlaps


def canonical_order(candidates: Sequence[str]) -> list[int]:
    """Candidate indices in the order the judge reads them: by a hash of the text, not by argument order."""
    return sorted(
        range(len(candidates)), key=lambda i: (hashlib.sha256(candidates[i].encode()).hexdigest(), i)
    )


class SpanJudgeResult(EvaluationResult):
    """An `EvaluationResult` with which candidate won, each candidate's overlap with the copy, and the usage."""

    choice: int | None = Field(
        default=None, description="The winning candidate's index, None for no decision."
    )
    overlaps: list[float] = Field(default_factory=list, description="Each candidate's overlap with the copy.")
    usage: dict[str, Any] = Field(default_factory=dict, description="Calls and tokens of the judgement.")


class SpanQueryPairwiseEvaluator(BaseEvaluator):
    """A drop-in for `PairwiseComparisonEvaluator` that judges in one call, candidates as order-free spans.

    `aevaluate(query, response, second_response, reference)` returns what LlamaIndex's evaluator returns:
    score 1.0 / passing True when `response` is better, 0.0 / False when `second_response` is, 0.5 / None for
    a tie (identical candidates), and `invalid_result` when the judge copied neither. `aselect(query,
    candidates)` picks the best of any number, `k` at a time (tree reduction).
    """

    def __init__(
        self,
        llm: SpanQueryLLM | None = None,
        *,
        system_prompt: str = DEFAULT_JUDGE_SYSTEM_PROMPT,
        instruction: str = DEFAULT_JUDGE_INSTRUCTION,
        max_tokens: int = 64,
        k: int = 2,
        min_overlap: float = 0.5,
        combine: Literal["model", "code", "auto"] = "model",
    ) -> None:
        check_fan_in(k, "k", "candidates")
        from spanq_integrations.runtime.judge import combine_mode
        from spanq_integrations.runtime.reducers import SelectReducer

        # The words `judge(combine=)` takes, meaning the same: "auto" is "code" here (picking the best by the leaf
        # judges' scores combines exactly in code); "model" (the default) a tree of pairwise judges.
        self._combine = combine_mode(SelectReducer(), combine, k)
        self._llm = span_query_llm(llm)
        self._system_prompt = system_prompt
        self._instruction = instruction
        self._max_tokens = max_tokens
        self._k = k
        self._min_overlap = min_overlap

    def _get_prompts(self) -> PromptDictType:
        return {
            "system_prompt": PromptTemplate(self._system_prompt),
            "instruction": PromptTemplate(self._instruction),
        }

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if "system_prompt" in prompts:
            self._system_prompt = prompts["system_prompt"].get_template()
        if "instruction" in prompts:
            self._instruction = prompts["instruction"].get_template()

    def build_query(self, query: str, candidates: Sequence[str], reference: str | None = None) -> Generate:
        """The judge's span query: the question (and reference), the candidates as a `plus`, the instruction."""
        if len(candidates) < 2:
            raise QueryValidationError(
                "candidates", f"a judge needs at least two candidates, got {len(candidates)}"
            )
        question = f"Question: {query}"
        if reference:
            question += f"\n\nReference:\n{reference}"
        spans = [fragment(candidates[i]) for i in canonical_order(candidates)]
        return self._llm.generate_call(
            cross(
                system(self._system_prompt),
                user(question),
                plus(*spans, anchor=self._llm.span_anchor),
                user(self._instruction),
            ),
            max_tokens=self._max_tokens,
            temperature=0.0,
        )

    async def aselect(
        self, query: str, candidates: Sequence[str], reference: str | None = None
    ) -> SpanJudgeResult:
        """The best of `candidates` for `query`: one call for up to k candidates, a tree of calls beyond."""
        if self._combine == "code" and len(candidates) > self._k:
            return await self._ascored(query, candidates, reference)
        judge = self.build_query(query, candidates, reference)
        tree_k = self._k if len(candidates) > self._k else None
        result = await self._llm.arun_query(judge, tree_reduction=tree_k)
        choice, overlaps = copied_candidate(result.answer, candidates, self._min_overlap)
        tie = choice is None and bool(overlaps) and max(overlaps) >= self._min_overlap
        return SpanJudgeResult(
            query=query,
            response=result.answer,
            feedback=result.answer,
            choice=choice,
            overlaps=overlaps,
            usage=usage_of(result),
            pairwise_source=ORDER_FREE_SOURCE,
            invalid_result=choice is None and not tie,
            invalid_reason=None
            if choice is not None or tie
            else "the judge's output copies none of the candidates",
        )

    async def _ascored(self, query: str, candidates: Sequence[str], reference: str | None) -> SpanJudgeResult:
        """Leaves rate k labelled candidates each; the highest score wins, in code."""
        from spanq_integrations.backends.protocol import ExecutionResult
        from spanq_integrations.query.errors import ReducerParseError
        from spanq_integrations.runtime.background_loop import background_loop
        from spanq_integrations.runtime.judge import ajudge
        from spanq_integrations.runtime.reducers import SelectReducer

        task = f"Question: {query}" + (f"\n\nReference:\n{reference}" if reference else "")
        task += "\n\nWhich candidate answers the question best: correct, relevant and helpful?"
        invalid_reason = None
        # labelled and grouped in the canonical order, not the caller's: a tie goes to the lowest label, which was
        # whichever candidate the caller passed first
        order = canonical_order(candidates)
        try:
            scored = ajudge(
                [candidates[i] for i in order],
                task,
                self._k,
                SelectReducer(),
                backend=await self._llm.aget_backend(),
                model=self._llm.model,
                max_tokens=self._max_tokens,
                temperature=0.0,
                combine="code",
                span_anchor=self._llm.span_anchor,
                recompute=self._llm.recompute,
            )
            judged = await background_loop().arun(scored)
        except ReducerParseError as e:
            judged, invalid_reason = e.result, "no judge gave a score for any candidate"  # type: ignore[attr-defined]
        choice = order[judged.verdict.index] if judged.verdict is not None else None
        run = ExecutionResult(tree=judged.tree, calls=judged.calls, wall_s=judged.metrics.wall_s, plan=judged.plan)
        feedback = "\n".join(f"{c.path}: {c.output}" for c in judged.levels[0].calls) if judged.levels else ""
        return SpanJudgeResult(
            query=query,
            response=judged.answer if choice is None else f"[{choice}]",  # (the label in the caller's order)
            feedback=feedback,
            choice=choice,
            usage=usage_of(run),
            pairwise_source=ORDER_FREE_SOURCE,
            invalid_result=choice is None,
            invalid_reason=invalid_reason,
        )

    async def aevaluate(
        self,
        query: str | None = None,
        response: str | None = None,
        contexts: Sequence[str] | None = None,
        second_response: str | None = None,
        reference: str | None = None,
        **kwargs: Any,
    ) -> SpanJudgeResult:
        """Whether `response` is better than `second_response` for `query` (see the class docstring)."""
        if query is None or response is None or second_response is None:
            raise QueryValidationError(
                "aevaluate", "query, response and second_response must be provided (reference is optional)"
            )
        result = await self.aselect(query, [response, second_response], reference)
        if result.choice is not None:
            result.score = 1.0 if result.choice == 0 else 0.0
            result.passing = result.choice == 0
        elif not result.invalid_result:  # both candidates copied equally: a tie
            result.score = 0.5
        return result
