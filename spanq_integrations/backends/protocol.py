"""The backend protocol: what the executor needs from a serving backend, the metrics every call reports, and
what a run returns (`ExecutionResult`, with its `Usage`)."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field

from spanq_integrations.optimizer.context import BackendCapabilities
from spanq_integrations.query.ir import Assistant, Generate, Node, Plus, child_paths, walk

__all__ = [
    "PROVIDER_PREFIXES",
    "AnswerTokenCallback",
    "Backend",
    "BackendCapabilities",
    "CallMetrics",
    "Completion",
    "ExecutionResult",
    "TokenCallback",
    "Usage",
    "answer_of",
    "bulk_generates",
    "server_model_name",
]

# spnl writes models as "provider/name"; these providers are not part of the name a server (or the embedded engine)
# knows. Every backend reads a call's model through `server_model_name`.
PROVIDER_PREFIXES = ("ollama/", "openai/", "vllm/", "spnl/")


def server_model_name(model: str) -> str:
    """The name a server knows: "vllm/tiny" → "tiny"; "HuggingFaceTB/SmolLM2" stays as it is."""
    for prefix in PROVIDER_PREFIXES:
        if model.startswith(prefix):
            return model[len(prefix) :]
    return model

TokenCallback = Callable[[str], Awaitable[None] | None]
AnswerTokenCallback = Callable[[int, str], Awaitable[None] | None]  # (the index of an answer, a piece of its text)


class CallMetrics(BaseModel):
    """One model call, as measured by the client: times in seconds, token counts as the server reported them."""

    path: str = "$"
    model: str = ""
    ttft_s: float | None = None
    wall_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV existed before this call (invariant 8 of docs/design.md)
    generated_tokens: int = 0
    padded_tokens: int = 0
    prepared_spans: int = 0
    # Tokens this call's own prepare requests computed (never counted as cached): its spans', and the last
    # block of each output a judge will read as a span (sealed when the output is done).
    prepared_tokens: int = 0
    # Spans that were not cached and that this call computed in context, as a stock prompt does; they are prepared
    # alone (for the next call) when the engine is idle, after this call.
    deferred_spans: int = 0
    fallback: str | None = None  # why the call's spans were sent as ordinary prompt text, when they were
    # The call's answers (one per choice, `n` of them) and why each ended, as the engine reported it: "stop" (an
    # end of sequence or a stop string), "length" (max_tokens), None where the backend did not say. Filled by the
    # executor from the backend's `Completion`.
    choices: list[str] = Field(default_factory=list)
    finish_reasons: list[str | None] = Field(default_factory=list)
    extra: dict[str, Any] = Field(default_factory=dict)

    @property
    def finish_reason(self) -> str | None:
        """Why the first choice ended (None: not reported)."""
        return self.finish_reasons[0] if self.finish_reasons else None


class Completion(BaseModel):
    """The answer to one `Generate`: `n` choices and the call's metrics."""

    texts: list[str]
    finish_reasons: list[str | None] = Field(default_factory=list)
    metrics: CallMetrics

    @property
    def text(self) -> str:
        return self.texts[0]


class Usage(BaseModel):
    """What a run of several calls cost, summed: the one aggregation every report (server, adapters, CLI)
    reads. `fallback` is the first call's reason for sending its spans as ordinary text, if any."""

    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    padded_tokens: int = 0
    prepared_spans: int = 0
    prepared_tokens: int = 0
    deferred_spans: int = 0
    fallback: str | None = None

    @classmethod
    def of(cls, calls: Iterable[CallMetrics]) -> Usage:
        calls = list(calls)
        return cls(
            calls=len(calls),
            prompt_tokens=sum(c.prompt_tokens for c in calls),
            cached_tokens=sum(c.cached_tokens for c in calls),
            generated_tokens=sum(c.generated_tokens for c in calls),
            padded_tokens=sum(c.padded_tokens for c in calls),
            prepared_spans=sum(c.prepared_spans for c in calls),
            prepared_tokens=sum(c.prepared_tokens for c in calls),
            deferred_spans=sum(c.deferred_spans for c in calls),
            fallback=next((c.fallback for c in calls if c.fallback), None),
        )

    def openai(self) -> dict[str, Any]:
        """In OpenAI's usage shape, with spanq's padded tokens, prepared spans and span fallback added."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.generated_tokens,
            "total_tokens": self.prompt_tokens + self.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "padded_tokens": self.padded_tokens,
            "prepared_spans": self.prepared_spans,
            "prepared_tokens": self.prepared_tokens,
            "deferred_spans": self.deferred_spans,
            "span_fallback": self.fallback,
        }


class UnreadAnswer(BaseModel):
    """An answer a combine in code could not read (it added nothing to the combined result): where, and why."""

    path: str  # the answer's path in the executed query, under its combine
    error: str  # the reducer's reason


class ExecutionResult(BaseModel):
    """What a run returns: the closed tree, every call's metrics (in completion order) and the wall time."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    tree: Any  # Node; typed loosely so pydantic does not re-validate large trees
    calls: list[CallMetrics] = Field(default_factory=list)
    wall_s: float = 0.0
    plan: Any = None  # the optimized tree that was executed
    answer_path: str | None = None  # the path of the call whose output is the answer (None: no one call's)
    unread: list[UnreadAnswer] = Field(default_factory=list)
    """Answers a `combine` in code could not read and so left out of its result (a judge whose answer does not
    follow its reducer's format); empty when every answer was read."""

    @property
    def answer_call(self) -> CallMetrics | None:
        """The metrics of the call that answered (its choices and finish reasons); None when the answer is not
        one call's output (a top-level `plus`, a query that generates nothing)."""
        if self.answer_path is None:
            return None
        return next((c for c in reversed(self.calls) if c.path == self.answer_path), None)

    @property
    def bulk_calls(self) -> list[CallMetrics] | None:
        """The calls whose outputs are the answers of a bulk query (a top-level `plus` of generate calls: `repeat`,
        `map`, a `plus` of `g`s; a call of `n` choices answers `n` times), in order; None for any other query."""
        generates = bulk_generates(self.plan)
        if generates is None or not (isinstance(self.tree, Plus) and len(self.tree.children) == len(generates)):
            return None
        by_path = {c.path: c for c in self.calls}  # (the last call of a path: a retried one's)
        calls = [by_path.get(path) for path, _ in generates]
        return None if None in calls else calls  # type: ignore[return-value]

    @property
    def bulk_answers(self) -> list[tuple[str, str | None]] | None:
        """A bulk query's answers (`bulk_calls`), each with its finish reason: every choice of every call, in
        order; None for any other query."""
        calls = self.bulk_calls
        if calls is None:
            return None
        out: list[tuple[str, str | None]] = []
        for c in calls:
            reasons = [*c.finish_reasons, *[None] * len(c.choices)]
            out += zip(c.choices or [""], reasons)
        return out

    @property
    def answer(self) -> str:
        """The text of the query's answer: the last generated output reached in reading order; of a call of `n`
        choices, its first (the one `on_token` streamed, whose finish reason `answer_call.finish_reason` is: it was
        the last choice). A bulk query's answers, each: `answers`."""
        called = self.answer_call
        if called is not None and len(called.choices) > 1:
            return called.choices[0]
        return answer_of(self.tree)

    @property
    def answers(self) -> list[str]:
        """Every answer: a bulk query's, each call's choices in order (`bulk_answers`); a call's `n` choices; else the one."""
        bulk = self.bulk_answers
        if bulk is not None:
            return [text for text, _ in bulk]
        called = self.answer_call
        if called is not None and len(called.choices) > 1:
            return list(called.choices)
        return [self.answer]

    @property
    def usage(self) -> Usage:
        """Totals over every call of the run."""
        return Usage.of(self.calls)

    def totals(self) -> dict[str, float]:
        """Token and time totals over all calls (as numbers, for tables)."""
        u = self.usage
        return {
            "calls": u.calls,
            "prompt_tokens": u.prompt_tokens,
            "cached_tokens": u.cached_tokens,
            "generated_tokens": u.generated_tokens,
            "padded_tokens": u.padded_tokens,
            "wall_s": self.wall_s,
        }


def bulk_generates(plan: Node) -> list[tuple[str, Generate]] | None:
    """The calls of a bulk query's plan (a top-level `plus` of generates: `repeat`, `map`, a `plus` of `g`s), with
    their paths, in order; None for any other plan."""
    if not (isinstance(plan, Plus) and all(isinstance(c, Generate) for c in plan.children)):
        return None
    return list(child_paths(plan, "$"))  # type: ignore[arg-type]


def answer_of(tree: Node) -> str:
    """The last generated `Assistant` text in reading order ("" if nothing was generated)."""
    last = ""
    for _, node in walk(tree):
        if isinstance(node, Assistant) and node.source is not None:
            last = node.text
    return last


class Backend(abc.ABC):
    """A serving backend. `generate` receives a `Generate` whose input is closed (no pending inner calls).

    A backend whose capabilities say `span_outputs` also accepts `span_output=True`: the executor passes it
    for an inner generate whose output an outer generate reads through a `plus`."""

    capabilities: BackendCapabilities

    @abc.abstractmethod
    async def generate(
        self, call: Generate, *, path: str = "$", on_token: TokenCallback | None = None
    ) -> Completion:
        """Run one model call; stream text pieces of the first choice to `on_token` as they arrive."""

    @property
    def identity(self) -> str:
        """What this backend answers with, as a string that is the same in every process (LangChain's cache key
        holds it: two backends whose answers may differ must differ here): its class and what it serves — its
        model, its server — where it says."""
        served = []
        for name in ("model_name", "base_url", "model"):
            with contextlib.suppress(Exception):  # (a property of a closed backend may fail: it is left out)
                if value := getattr(self, name, None):
                    served.append(f"{name}={value}")
        return f"{type(self).__name__}({', '.join(served)})"

    async def token_ids(self, text: str, model: str = "") -> list[int] | None:
        """`text` as the model's tokenizer splits it (no special tokens), or None where this backend cannot say
        (a server without vLLM's `/tokenize`): what LangChain's `get_num_tokens` and `trim_messages` count by."""
        return None

    async def aclose(self) -> None:
        """Release connections and engines; the backend is unusable afterwards."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
