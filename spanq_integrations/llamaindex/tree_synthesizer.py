"""`SpanQueryTreeSynthesizer`: tree reduction over retrieved nodes that keeps node boundaries.

LlamaIndex's `TreeSummarize` repacks the node texts to fill the context window, answers each packed chunk and
summarizes the answers, level by level: node boundaries are lost and the chunks change whenever the retrieved
set does. This synthesizer reads k nodes per call instead (default 2: pairwise), each node its own span, and
then k answers per call, up the tree, until one call reads at most k inputs and gives the answer. The tree is
the optimizer's rule 5 (`spanq_integrations.optimizer.tree_reduce`) applied to the flat synthesizer's query:
N nodes, k=2 gives N - 1 calls in ⌈log2 N⌉ levels; calls of one level run concurrently.

Answers that combine exactly in code (a list of items, a count, a vote) need no model above the leaves:
`reducer="extract"` (or `count`, `vote`) makes the tree ⌈N / k⌉ leaf calls whose answers are combined in code
by that reducer (`extract`: the union of their items, one per line, in order). Free-form answers keep the
default, model calls at every level, since merging them needs judgement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spanq_integrations.llamaindex.llm import SpanQueryLLM
from spanq_integrations.llamaindex.synthesizer import SpanQuerySynthesizer
from spanq_integrations.optimizer.context import TreeReduction
from spanq_integrations.query.errors import check_fan_in
from spanq_integrations.query.ir import Fragment

__all__ = ["SpanQueryTreeSynthesizer"]


class SpanQueryTreeSynthesizer(SpanQuerySynthesizer):
    """A k-ary tree of answers over the nodes (k=2 by default), each leaf call reading k nodes as spans.

    `intermediate_instruction`, when given, is the user turn of the inner calls (for example "Summarize what
    these documents say about the question"); by default every call is asked the question itself, as
    `TreeSummarize` does. `reducer` (`extract`, `count`, `vote`): the leaves' answers are combined in code by
    that reducer, no model call above them (`TreeReduction(combine="code")`). Every other argument is `SpanQuerySynthesizer`'s;
    `metadata["spanq"]["per_call"]` lists each call of the tree with its path.
    """

    def __init__(
        self,
        llm: SpanQueryLLM | None = None,
        *,
        k: int = 2,
        intermediate_instruction: str | None = None,
        reducer: str | None = None,
        **kwargs: Any,
    ) -> None:
        check_fan_in(k, "k", "nodes or answers")
        if reducer is not None:
            from spanq_integrations.runtime.reducers import reducer_from_combine

            reducer_from_combine(reducer, {}, "SpanQueryTreeSynthesizer")  # a clear error for one that cannot
        super().__init__(llm, **kwargs)
        self._k = k
        self._intermediate_instruction = intermediate_instruction
        self._reducer = reducer

    @property
    def k(self) -> int:
        return self._k

    def _context_advice(self, message: str, fragments: Sequence[Fragment]) -> str:
        return (
            f"one call of the tree does not fit the model's context window ({message}): a node is too long, or "
            f"{self._k} of them together are; split the documents into smaller nodes (e.g. "
            "SentenceSplitter(chunk_size=256)), lower k, or lower max_tokens"
        )

    def _run_options(self) -> dict[str, Any]:
        plan = TreeReduction(
            k=self._k,
            combine="model" if self._reducer is None else "code",
            instruction=self._intermediate_instruction,
            reducer=self._reducer,
        )
        return {"tree_reduction": plan}
