"""`JudgeEnsemble`: N candidate generations and the judge over them as one span query, as a LangChain runnable.

    judge = JudgeEnsemble(llm=ChatSpanQuery(max_tokens=64), n=4, k=2)
    verdict = judge.invoke("Which town can only be reached by ferry?")
    verdict.selection, verdict.candidates, verdict.reused_outputs

It runs spanq's judge (`spanq_integrations.runtime.judge.ajudge`) with inner generations as its candidates: the judge is
`G(cross(system, plus(G_1 … G_n), instruction))`, so the candidates run concurrently inside the same query and
each judge reads the finished candidates as spans of its `plus`. `k=k` makes it a k-ary tree of
judges (attention locality); the reducer template (`select` by default, also `extract`, `count`, `vote`,
`merge`) says what a judge answers, and `combine` how a tree combines answers: in code where the reducer's
combine is exact (`auto`, the default: the leaves rate candidates and the highest score wins for `select`), or
by model calls at every level (`combine="model"`: a tournament for `select`). `documents` in the input go to every generator as one `plus` of spans, computed
once and shared. Given `candidates` in the input, only the judging runs (for example as the reduce step of a
LangGraph map-reduce; see examples/judge/langchain_judge_graph.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from langchain_core.documents import Document
from langchain_core.messages import BaseMessage
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import BaseModel, ConfigDict, Field

from spanq_integrations.backends.protocol import CallMetrics
from spanq_integrations.langchain.chat_models import ChatSpanQuery
from spanq_integrations.langchain.spans import document_span_id
from spanq_integrations.query.errors import ReducerParseError
from spanq_integrations.query.ir import Node, cross, fragment, generate, plus, system, user
from spanq_integrations.runtime.background_loop import background_loop
from spanq_integrations.runtime.judge import (
    DEFAULT_JUDGE_MAX_TOKENS,
    JudgeLevel,
    JudgeMetrics,
    JudgeResult,
    ajudge,
)
from spanq_integrations.runtime.reducers import Selection, resolve_reducer

__all__ = ["DEFAULT_JUDGE_TASK", "JudgeEnsemble", "JudgeVerdict"]

DEFAULT_JUDGE_TASK = "Which candidate answers the question best?"
GENERATOR_INSTRUCTION = "Answer the question briefly."


class JudgeVerdict(BaseModel):
    """What a judge ensemble returns."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    question: str
    verdict: str
    """The root judge's answer, as it wrote it."""
    parsed: Any = None
    """The verdict read by the reducer: a `Selection` for `select`, a list of items for `extract`, the merged
    text for `merge`; None when the answer could not be read (`strict=False`)."""
    parse_error: str | None = None
    """Why the root's answer could not be read, when it could not."""
    candidates: list[str]
    """The candidates' texts (in seed order when generated)."""
    reused_outputs: list[str]
    """Generated outputs that a judge read as spans of its `plus`: the generated candidates and the answers of
    intermediate judges. On a span-aware backend each is computed once and read from the span cache."""
    judge_cached_tokens: int = 0
    """Prompt tokens the judges' calls took from the cache, every judge of the tree (it was the root's alone: 0
    wherever the root is a combine in code, which makes no call)."""
    levels: list[JudgeLevel] = Field(default_factory=list)
    """The judge calls level by level (level 1 reads candidates), with what each read and answered."""
    calls: list[CallMetrics] = Field(default_factory=list)
    """Every call of the query (generators and judges), in completion order."""
    metrics: JudgeMetrics = Field(default_factory=JudgeMetrics)
    k: int | None = None
    """The fan-in of the tree of judges (each read at most k candidates or answers); None for one flat judge."""
    combine: str | None = None
    """How the tree combined its judges' answers (`code` or `model`); None for one flat judge."""

    @property
    def selection(self) -> Selection | None:
        """The chosen candidate (`select`), or None."""
        return self.parsed if isinstance(self.parsed, Selection) else None


class JudgeEnsemble(RunnableSerializable[Any, JudgeVerdict]):
    """Generate `n` candidates and judge them in one span query; see the module docstring.

    Input: a question (str), or a dict with `"question"` (or `"input"`), optionally `"documents"` (Documents or
    strings that every generator reads) and `"candidates"` (strings or messages: judge these instead of
    generating). The backend, model and `max_tokens` come from `llm`. With `strict=False` (the default) a root
    answer the reducer cannot read (a small model that names no candidate) leaves `parsed` None; with
    `strict=True` it raises `ReducerParseError`.
    """

    llm: ChatSpanQuery = Field(default_factory=ChatSpanQuery)
    n: int = Field(default=4, ge=1)
    k: int | None = Field(default=None, ge=2)
    """Tree reduction's fan-in: each judge reads at most k candidates (or answers); None: one flat judge.
    The same name as `judge(k=)` and LlamaIndex's judges."""
    reducer: Any = "select"
    combine: Literal["auto", "code", "model"] = "auto"
    task: str = DEFAULT_JUDGE_TASK
    strict: bool = False
    generator_instruction: str = GENERATOR_INSTRUCTION
    candidate_temperature: float = Field(default=0.8, ge=0.0)
    candidate_max_tokens: int | None = Field(default=None, ge=1)
    judge_max_tokens: int | None = Field(default=None, ge=1)
    seed: int = 0

    model_config = ConfigDict(arbitrary_types_allowed=True)

    @property
    def InputType(self) -> Any:
        return str | dict

    @property
    def OutputType(self) -> Any:
        return JudgeVerdict

    # ----------------------------------------------------------------------------------------- the query

    @staticmethod
    def _read_input(value: Any) -> tuple[str, list[Any], list[str] | None]:
        from spanq_integrations.query.errors import ArgumentTypeError, ArgumentValueError

        if isinstance(value, str):
            if not value.strip():  # (it ran the generations and the judges on no question at all)
                raise ArgumentValueError("JudgeEnsemble.invoke(input)", "needs a non-empty question")
            return value, [], None
        if not isinstance(value, dict):
            raise ArgumentTypeError("JudgeEnsemble.invoke(input)",
                                    f"takes a question (str) or a dict, got {type(value).__name__}")
        question = value.get("question", value.get("input"))
        if not isinstance(question, str) or not question.strip():
            raise ArgumentValueError("JudgeEnsemble.invoke(input)", "needs a non-empty 'question' (or 'input')")
        candidates = value.get("candidates")
        if candidates is not None:
            if isinstance(candidates, (str, BaseMessage)) or not hasattr(candidates, "__iter__"):
                raise ArgumentTypeError("JudgeEnsemble.invoke(input['candidates'])",
                                        f"takes a list of answers, got {type(candidates).__name__}")
            candidates = [c.text if isinstance(c, BaseMessage) else str(c) for c in candidates]
            if not candidates:
                raise ArgumentValueError("JudgeEnsemble.invoke(input['candidates'])",
                                         "is empty: there is nothing to judge")
        return question, list(value.get("documents") or ()), candidates

    def generators(self, question: str, documents: Sequence[Any] = ()) -> list[Node]:
        """The `n` candidate generations: one input (the documents as one `plus`, under the model's `span_anchor`
        and `recompute`), distinct seeds."""
        context = [
            fragment(d.page_content, id=document_span_id(d)) if isinstance(d, Document) else fragment(str(d))
            for d in documents
        ]
        generator_input = cross(
            system(self.generator_instruction),
            *([plus(context, anchor=self.llm.span_anchor)] if context else []),
            user(question),
        )
        return [
            generate(
                generator_input,
                model=self.llm.model or "",
                max_tokens=self.candidate_max_tokens or self.llm.max_tokens or 0,
                temperature=self.candidate_temperature,
                seed=self.seed + i,
                recompute=self.llm.recompute,
            )
            for i in range(self.n)
        ]

    def _instruction(self, question: str) -> str:
        return f"Question: {question}\n\n{self.task}"

    # ----------------------------------------------------------------------------------------- running

    async def _ajudge(self, value: Any) -> JudgeVerdict:
        question, documents, given = self._read_input(value)
        candidates: list[Any] = given if given is not None else self.generators(question, documents)
        try:
            result = await ajudge(
                candidates,
                self._instruction(question),
                k=self.k,
                reducer=resolve_reducer(self.reducer),
                backend=await self.llm._aget_backend(),
                model=self.llm.model or "",
                max_tokens=self.judge_max_tokens or self.llm.max_tokens or DEFAULT_JUDGE_MAX_TOKENS,
                temperature=0.0,
                seed=self.seed,
                combine=self.combine,
                span_anchor=self.llm.span_anchor,
                recompute=self.llm.recompute,
            )
        except ReducerParseError as e:
            if self.strict or getattr(e, "result", None) is None:
                raise
            result = e.result  # type: ignore[attr-defined]  # the run, verdict None
        return self._verdict(question, result, generated=given is None)

    def _verdict(self, question: str, result: JudgeResult, *, generated: bool) -> JudgeVerdict:
        root = result.levels[-1].calls[0] if result.levels else None
        reused = [
            inp.text
            for call in result.judge_calls
            if call.kind == "model"  # a combine in code reads answers as values, not as spans
            for inp in call.inputs
            if inp.kind == "call" or (generated and inp.kind == "candidate")
        ]
        parse_error = None
        if root is not None and result.verdict is None:
            parse_error = root.parse_error or f"the reducer {result.reducer!r} could not read the root judge's answer"
        return JudgeVerdict(
            question=question,
            verdict=result.answer,
            parsed=result.verdict,
            parse_error=parse_error,
            candidates=result.candidates,
            reused_outputs=reused,
            judge_cached_tokens=sum(c.metrics.cached_tokens for c in result.judge_calls if c.metrics is not None),
            levels=result.levels,
            calls=result.calls,
            metrics=result.metrics,
            k=self.k,
            combine=result.combine,
        )

    def _judge(self, value: Any) -> JudgeVerdict:
        return background_loop().run(self._ajudge(value))

    async def _ajudge_on_loop(self, value: Any) -> JudgeVerdict:
        return await background_loop().arun(self._ajudge(value))

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> JudgeVerdict:
        return self._call_with_config(self._judge, input, config, run_type="chain")

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> JudgeVerdict:
        return await self._acall_with_config(self._ajudge_on_loop, input, config, run_type="chain")
