"""Judges over many candidates, flat or as a tree of narrow judges (attention locality), on any backend.

    result = judge(candidates, "Tell me the names of the cats mentioned.", k=2, reducer="extract")
    result.verdict          # ['Ada Moreau', 'Bo Lind', …]
    result.levels           # level 1 (4 calls over the candidates) … level 3 (the root)
    result.metrics          # calls, tokens, wall time

The judge is the query `G(cross(system, plus(candidates), user(instruction)))` of a reducer template
(`reducers`); `k` turns on the optimizer's tree-reduction rule, which rewrites it into a k-ary tree of judges
that each read at most k inputs (8 candidates, k=2: 4 + 2 + 1 = 7 calls in 3 levels). It needs nothing from
the server, so it runs on any OpenAI-compatible endpoint, on `spanq serve` and embedded. Calls of one level run
concurrently (they are independent `plus` children); a judge starts as soon as its own inputs are done.

Candidates are texts or query nodes; a `Generate` (or `Chat`) candidate is an inner generation that runs inside
the same tree. Candidates are opaque to the rewrite: they are optimized on their own (without tree reduction)
and put back in place, so a candidate's own `plus` is neither flattened into the judge's nor reduced.

Where the reducer's combine step is exact in code (`extract`'s union, `select`'s highest score, `count`'s sum,
`vote`'s majority) the tree asks the model only at its leaves (`combine="code"`, the default for those
reducers): N=8, k=2 gives 4 leaf calls and one combine in code, which a small model cannot get wrong by
dropping items while merging lists. `combine="model"` keeps model calls at every level (`merge` always does).

The levels are read back from the executed tree's provenance: each judge's answer is an `Assistant` whose
`source` is the closed call (a `Generate`, or the `Combine` of a code level), whose input holds the answers (or
candidates) it read.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spanq_integrations.backends.protocol import Backend, BackendCapabilities, CallMetrics
from spanq_integrations.backends.resolve import embedded_model_named, resolve_backend
from spanq_integrations.optimizer.context import TreeReduction
from spanq_integrations.query.errors import QueryValidationError, ReducerParseError, check_fan_in
from spanq_integrations.query.flatten import block_text
from spanq_integrations.query.ir import (
    NODE_TYPES,
    AnchorPolicy,
    Assistant,
    Combine,
    Cross,
    Fragment,
    Generate,
    Monad,
    Node,
    Plus,
    Print,
    Recompute,
    System,
    User,
    child_paths,
    children_of,
    cross,
    generate,
    plus,
    system,
    transform,
    user,
    with_children,
)
from spanq_integrations.runtime.executor import ExecutionResult, aexecute, runs_anything, shown_texts
from spanq_integrations.runtime.reducers import Reducer, resolve_reducer
from spanq_integrations.runtime.sync import run_sync

__all__ = [
    "JudgeCall",
    "JudgeInput",
    "JudgeLevel",
    "JudgeMetrics",
    "JudgeResult",
    "ajudge",
    "judge",
    "judge_plan",
    "judge_query",
    "tree_reduction_of",
]

Candidate = str | Node
CombineMode = Literal["auto", "code", "model"]
COMBINE_MODES: tuple[str, ...] = ("auto", "code", "model")
_TEXT_TYPES = (System, User, Assistant, Fragment)
DEFAULT_JUDGE_MAX_TOKENS = 256


# --------------------------------------------------------------------------------------------- results


class JudgeInput(BaseModel):
    """One input of a judge call: an original candidate (by index) or the answer of a lower judge (by path)."""

    kind: Literal["candidate", "call"]
    index: int | None = None  # the candidate's index, for kind="candidate"
    path: str | None = None  # the lower judge's call path, for kind="call"
    text: str


class JudgeCall(BaseModel):
    """One judge call of the executed tree: where it ran, what it read, what it answered."""

    path: str
    level: int  # 1: reads only candidates; the root has the highest level
    inputs: list[JudgeInput]
    output: str
    kind: Literal["model", "code"] = "model"  # code: the answers below were combined in code, no model call
    metrics: CallMetrics | None = None  # None for a combine in code
    parsed: Any = None  # the output read by the reducer (intermediate answers too)
    parse_error: str | None = None  # why an intermediate answer could not be read (the root's raises)


class JudgeLevel(BaseModel):
    level: int
    calls: list[JudgeCall]


class JudgeMetrics(BaseModel):
    """The cost of a judge run: judge calls, every call (inner generations too), tokens and wall time."""

    judge_calls: int = 0  # model calls of judges (a combine in code is not one)
    code_combines: int = 0  # levels of the tree combined in code
    calls: int = 0
    levels: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0


class JudgeResult(BaseModel):
    """What `judge` returns: the verdict (per reducer), the levels read from provenance, and the cost."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    verdict: Any
    reducer: str
    k: int | None
    combine: Literal["code", "model"] | None = None  # how a tree's answers were combined; None: flat
    candidates: list[str]  # the candidates' texts (inner generations' outputs once they ran)
    levels: list[JudgeLevel] = Field(default_factory=list)  # level 1 first, the root's level last
    calls: list[CallMetrics] = Field(default_factory=list)  # every call, in completion order
    metrics: JudgeMetrics = Field(default_factory=JudgeMetrics)
    tree: Any = None  # the closed tree
    plan: Any = None  # the executed plan

    @property
    def answer(self) -> str:
        """The root judge's raw answer ("" when no judge call was needed)."""
        return self.levels[-1].calls[0].output if self.levels else ""

    @property
    def judge_calls(self) -> list[JudgeCall]:
        return [c for level in self.levels for c in level.calls]


# --------------------------------------------------------------------------------------------- queries


def _check_k(k: int | None) -> None:
    check_fan_in(k, "k", "candidates", none="pass None for one flat judge over all candidates")


def combine_mode(reducer: Reducer, combine: str, k: int | None) -> Literal["code", "model"] | None:
    """How a tree of judges with `reducer` combines answers (`auto`: in code where the reducer can); None
    for a flat judge (`k=None`). A clear error for an unknown mode or `code` with a reducer that cannot."""
    if combine not in COMBINE_MODES:
        raise QueryValidationError(
            "judge(combine)", f"unknown combine mode {combine!r}: one of {', '.join(COMBINE_MODES)}"
        )
    if combine == "code" and not reducer.combines_in_code:
        raise QueryValidationError(
            "judge(combine)",
            f"the {reducer.name} reducer needs judgement to combine answers: use combine='model' or 'auto'",
        )
    if k is None:
        return None
    if combine == "auto":
        return "code" if reducer.combines_in_code else "model"
    return combine  # type: ignore[return-value]


def _as_candidate(candidate: Candidate, index: int) -> Node:
    if isinstance(candidate, str):
        return Fragment(text=candidate)
    if isinstance(candidate, (Monad, Print)):
        raise QueryValidationError(
            f"judge(candidates)[{index}]", f"a {candidate.kind} is an effect, not a candidate to judge"
        )
    if isinstance(candidate, NODE_TYPES):
        return candidate
    raise QueryValidationError(
        f"judge(candidates)[{index}]",
        f"a candidate must be a string or a query node (a Generate for an inner generation), "
        f"got {type(candidate).__name__}",
    )


def _check_instruction(instruction: str) -> None:
    """What the judges are asked: a text with something in it (None or "" ran them with no question at all)."""
    if not isinstance(instruction, str) or not instruction.strip():
        got = "an empty string" if isinstance(instruction, str) else type(instruction).__name__
        raise QueryValidationError("judge(instruction)", f"the judges need an instruction (what to pick, extract or "
                                   f"count), got {got}")


def _candidates(candidates: Sequence[Candidate]) -> list[Node]:
    if isinstance(candidates, (str, BaseModel)):
        raise QueryValidationError("judge(candidates)", "pass a list of candidates, not a single one")
    if not isinstance(candidates, Iterable):  # (None: a TypeError from inside the loop below)
        raise QueryValidationError("judge(candidates)", f"pass a list of candidates, got {type(candidates).__name__}")
    nodes = [_as_candidate(c, i) for i, c in enumerate(candidates)]
    if not nodes:
        raise QueryValidationError("judge(candidates)", "there are no candidates to judge: pass at least one")
    return nodes


def _judge_generate(
    reducer: Reducer,
    candidates: Sequence[Node],
    instruction: str,
    settings: dict[str, Any],
    span_anchor: AnchorPolicy | None = None,
) -> Generate:
    try:  # (the builders: a setting out of range is a QueryValidationError naming it, not pydantic's error)
        spans = plus(*candidates, anchor=span_anchor)
        return generate(cross(system(reducer.system_prompt), spans, user(reducer.instruction(instruction))), **settings)
    except QueryValidationError as e:
        where = re.sub(r"^(generate|plus)\((anchor)?", lambda m: "judge(span_anchor" if m[2] else "judge(", e.path)
        raise QueryValidationError(where, e.message) from None


def _settings(
    model: str, max_tokens: int, temperature: float, seed: int | None, recompute: Recompute | None = None
) -> dict[str, Any]:
    # Candidates a span engine has not cached are read each alone first, whatever their size: the verdict must
    # not depend on which candidate came first, even the first time (docs/design.md, "Cold spans").
    return {"model": model, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "cold_spans": "isolate", "recompute": recompute}


def judge_query(
    candidates: Sequence[Candidate],
    instruction: str,
    reducer: Reducer | str = "extract",
    *,
    model: str = "",
    max_tokens: int = DEFAULT_JUDGE_MAX_TOKENS,
    temperature: float = 0.0,
    seed: int | None = None,
    span_anchor: AnchorPolicy | None = None,
    recompute: Recompute | None = None,
) -> Generate:
    """The flat judge as a span query: one call that reads every candidate. `optimize(..., tree_reduction=
    tree_reduction_of(reducer, instruction, k, "model"))` turns it into the tree. `span_anchor`, `recompute`:
    the candidates' anchor policy and the judges' recompute setting on a span engine (None: the backend's)."""
    r = resolve_reducer(reducer)
    _check_instruction(instruction)
    nodes = [r.present(i, c) for i, c in enumerate(_candidates(candidates))]
    return _judge_generate(r, nodes, instruction, _settings(model, max_tokens, temperature, seed, recompute), span_anchor)


def tree_reduction_of(
    reducer: Reducer | str, instruction: str, k: int | None, combine: Literal["code", "model"]
) -> TreeReduction | None:
    """The tree reduction a judge with this reducer and instruction plans (None without `k`): leaf judges that
    read the reducer's leaf instruction under its exact combine in code, or judges that read its intermediate
    instruction at every level up to the root."""
    if k is None:
        return None
    r = resolve_reducer(reducer)
    if combine == "code":
        return TreeReduction(
            k=k, combine="code", instruction=r.leaf_instruction(instruction), reducer=r.name, options=r.options()
        )
    return TreeReduction(k=k, instruction=r.intermediate_instruction(instruction))


def judge_plan(
    candidates: Sequence[Candidate],
    instruction: str,
    k: int | None = 2,
    reducer: Reducer | str = "extract",
    capabilities: BackendCapabilities | None = None,
    *,
    model: str = "",
    max_tokens: int = DEFAULT_JUDGE_MAX_TOKENS,
    temperature: float = 0.0,
    seed: int | None = None,
    combine: CombineMode = "auto",
    span_anchor: AnchorPolicy | None = None,
    recompute: Recompute | None = None,
) -> Node:
    """The optimized query `judge` runs: the flat judge rewritten by the optimizer's tree-reduction rule.

    `combine`: `code` (the default, `auto`, for reducers that can) plans leaf judges under a `Combine` node,
    `model` a tree of model calls up to the root.

    The candidates stand in as placeholders while the optimizer runs, then are put back, each optimized on
    its own: the rule groups them without looking inside, and reduces nothing within them.
    """
    from spanq_integrations.optimizer import optimize

    _check_k(k)
    r = resolve_reducer(reducer)
    mode = combine_mode(r, combine, k)
    _check_instruction(instruction)
    nodes = _candidates(candidates)
    nonce = secrets.token_hex(6)
    placeholders = [Fragment(text=f"\u27e6spanq-judge-candidate:{i}:{nonce}\u27e7") for i in range(len(nodes))]
    flat = _judge_generate(
        r, placeholders, instruction, _settings(model, max_tokens, temperature, seed, recompute), span_anchor
    )
    tree = optimize(flat, capabilities, tree_reduction=tree_reduction_of(r, instruction, k, mode or "model"))
    presented = {
        p.text: r.present(i, optimize(c, capabilities)) for i, (p, c) in enumerate(zip(placeholders, nodes))
    }

    def back(child: Node, in_group: bool) -> Node:
        candidate = presented.get(child.text) if isinstance(child, Fragment) else None
        if candidate is None:
            return child
        if in_group:
            return candidate
        # Alone (the optimizer unwraps a group of one where spans do not keep it), a candidate goes back in a group
        # of its own: put in the judge's `cross` itself, a message candidate was a turn of its own role (a generated
        # one the judge's own earlier answer) and a select judge found no label.
        return Plus(children=(candidate,), anchor=span_anchor)

    def put_back(node: Node) -> Node:  # (`with_children` keeps the node itself where no child changed)
        return with_children(node, [back(c, isinstance(node, Plus)) for c in children_of(node)])

    return transform(tree, put_back)


# --------------------------------------------------------------------------------------------- provenance


class _Reader:
    """Reads the judge calls, level by level, out of an executed tree."""

    def __init__(self, reducer: Reducer, instruction: str, n: int, calls: Sequence[CallMetrics]):
        self.reducer = reducer
        self.system = System(text=reducer.system_prompt)
        self.instructions = {reducer.instruction(instruction), reducer.intermediate_instruction(instruction)}
        if reducer.combines_in_code:
            self.instructions.add(reducer.leaf_instruction(instruction))
        self.metrics = {c.path: c for c in calls}
        self.texts: list[str] = [""] * n
        self.judges: list[JudgeCall] = []
        self.leaves: dict[str, list[str]] = {}  # path of a judge whose answer is combined in code → what it read
        self._next_candidate = 0

    def is_judge(self, node: Node) -> bool:
        """A judge's answer: generated from `cross(our system, group, our instruction)`."""
        if not (isinstance(node, Assistant) and isinstance(node.source, Generate)):
            return False
        inp = node.source.input
        return (
            isinstance(inp, Cross)
            and len(inp.children) == 3
            and inp.children[0] == self.system
            and isinstance(inp.children[2], User)
            and inp.children[2].text in self.instructions
        )

    def read(self, node: Node, path: str) -> tuple[int, JudgeInput]:
        """(height, input) of a `plus` child: a judge's answer (height >= 1) or a candidate (height 0)."""
        if isinstance(node, Assistant) and isinstance(node.source, Combine):
            return self.read_combine(node, path)
        if not self.is_judge(node):
            index = self._next_candidate  # tree reduction keeps the candidates' order: read them in order
            self._next_candidate += 1
            text = self.reducer.candidate_text(index, node)
            if index < len(self.texts):
                self.texts[index] = text
            return 0, JudgeInput(kind="candidate", index=index, text=text)
        g: Generate = node.source  # type: ignore[union-attr,assignment]
        ((input_path, cross),) = child_paths(g, path)
        base, group = list(child_paths(cross, input_path))[1]
        if isinstance(group, Plus):
            read = [self.read(child, child_path) for child_path, child in child_paths(group, base)]
        else:  # one candidate: the optimizer dropped the single-child plus
            read = [self.read(group, base)]
        level = 1 + max(height for height, _ in read)
        self.judges.append(
            JudgeCall(
                path=path,
                level=level,
                inputs=[inp for _, inp in read],
                output=node.text,  # type: ignore[union-attr]
                metrics=self.metrics.get(path),
            )
        )
        return level, JudgeInput(kind="call", path=path, text=node.text)  # type: ignore[union-attr]

    def read_combine(self, node: Assistant, path: str) -> tuple[int, JudgeInput]:
        """A combine in code over judges' answers: one level above the highest of them, no model call."""
        combine: Combine = node.source  # type: ignore[assignment]
        ((base, inp),) = child_paths(combine, path)
        children = list(child_paths(inp, base)) if isinstance(inp, Plus) else [(base, inp)]
        read = []
        for child_path, child in children:
            if isinstance(child, (Monad, Print)):
                continue
            read.append(self.read(child, child_path))
            if read[-1][1].kind == "call":
                self.leaves[child_path] = shown_texts(child)
        level = 1 + max((height for height, _ in read), default=0)
        self.judges.append(
            JudgeCall(path=path, level=level, inputs=[i for _, i in read], output=node.text, kind="code")
        )
        return level, JudgeInput(kind="call", path=path, text=node.text)

    def parsed_of(self, inp: JudgeInput) -> Any:
        """The partial result a combine reads from one of its inputs (None for one that could not be read)."""
        call = next((c for c in self.judges if c.path == inp.path), None) if inp.kind == "call" else None
        return None if call is None or call.parse_error else call.parsed

    def levels(self) -> list[JudgeLevel]:
        by_level: dict[int, list[JudgeCall]] = {}
        for call in self.judges:
            by_level.setdefault(call.level, []).append(call)
        return [JudgeLevel(level=lv, calls=by_level[lv]) for lv in sorted(by_level)]  # each left to right


def _metrics(levels: list[JudgeLevel], run: ExecutionResult) -> JudgeMetrics:
    totals = run.totals()
    return JudgeMetrics(
        judge_calls=sum(c.kind == "model" for level in levels for c in level.calls),
        code_combines=sum(c.kind == "code" for level in levels for c in level.calls),
        calls=int(totals["calls"]),
        levels=len(levels),
        prompt_tokens=int(totals["prompt_tokens"]),
        cached_tokens=int(totals["cached_tokens"]),
        generated_tokens=int(totals["generated_tokens"]),
        wall_s=run.wall_s,
    )


# --------------------------------------------------------------------------------------------- running


async def _lone(
    r: Reducer, candidate: Node, k: int | None, backend: Backend, max_concurrency: int | None
) -> JudgeResult:
    """One candidate and a reducer that needs no call for it: the verdict is the candidate (an inner
    generation among the candidates still runs, alone)."""
    if isinstance(candidate, _TEXT_TYPES):
        return JudgeResult(verdict=r.lone(candidate.text), reducer=r.name, k=k, candidates=[candidate.text])
    if not runs_anything(candidate):
        text = block_text(candidate)  # messages only (a question and its answer, say): nothing to run
        return JudgeResult(verdict=r.lone(text), reducer=r.name, k=k, candidates=[text])
    from spanq_integrations.optimizer import optimize

    plan = optimize(candidate, backend.capabilities)
    run = await aexecute(plan, backend, optimize=False, max_concurrency=max_concurrency)
    text = block_text(run.tree)
    return JudgeResult(
        verdict=r.lone(text), reducer=r.name, k=k, candidates=[text], calls=run.calls,
        metrics=_metrics([], run), tree=run.tree, plan=plan,
    )  # fmt: skip


async def ajudge(
    candidates: Sequence[Candidate],
    instruction: str,
    k: int | None = 2,
    reducer: Reducer | str = "extract",
    *,
    backend: Backend | str | None = None,
    model: str = "",
    max_tokens: int = DEFAULT_JUDGE_MAX_TOKENS,
    temperature: float = 0.0,
    seed: int | None = None,
    max_concurrency: int | None = None,
    combine: CombineMode = "auto",
    span_anchor: AnchorPolicy | None = None,
    recompute: Recompute | None = None,
    api_key: str | None = None,
) -> JudgeResult:
    """Judge `candidates` by `instruction` with a reducer template; `k` (>= 2) makes it a k-ary tree of judges,
    `k=None` one flat judge. `backend` is a `Backend`, a URL, or None for the embedded default. `combine`:
    how a tree combines its judges' answers, `code` (model calls at the leaves only; `auto`, the default, where
    the reducer's combine is exact in code: extract, select by scores, count, vote) or `model` (model calls at
    every level: the only way for `merge`). `span_anchor`, `recompute`: on a span engine, what each candidate's
    KV is computed after (see `plus`) and how much of it the judges compute again in context (see `generate`);
    None: the backend's defaults. `api_key`: the bearer token a URL backend sends (default: `$SPANQ_API_KEY`).

    Errors: `QueryValidationError` for k < 2, no candidates or an unknown reducer (before any call);
    `ReducerParseError` when the root's answer cannot be parsed: it names the call's path, shows the output
    (`.path`, `.output`) and carries the run as `.result` (verdict None) for a fallback of your own.
    Intermediate answers that cannot be parsed are recorded in their `JudgeCall.parse_error`.
    """
    _check_k(k)
    r = resolve_reducer(reducer)
    mode = combine_mode(r, combine, k)
    _check_instruction(instruction)
    nodes = _candidates(candidates)
    be, owned = resolve_backend(backend, embedded_model_named(backend, model), api_key=api_key)
    try:
        if len(nodes) == 1 and not r.reads_a_lone_candidate:
            return await _lone(r, nodes[0], k, be, max_concurrency)
        plan = judge_plan(
            nodes, instruction, k, r, be.capabilities,
            model=model, max_tokens=max_tokens, temperature=temperature, seed=seed, combine=mode or "model",
            span_anchor=span_anchor, recompute=recompute,
        )  # fmt: skip
        run = await aexecute(
            plan, be, optimize=False, max_concurrency=max_concurrency, reducers={r.name: r}
        )
    finally:
        if owned:
            await be.aclose()

    reader = _Reader(r, instruction, len(nodes), run.calls)
    reader.read(run.tree, "$")
    levels = reader.levels()
    root = levels[-1].calls[0]
    root_error: ReducerParseError | None = None
    for call in reader.judges:  # every call after the calls it read
        try:
            if call.kind == "code":
                partials = [reader.parsed_of(i) for i in call.inputs]
                combined = r.combine(partials)
                try:
                    call.parsed = (
                        r.verdict(combined, path=call.path, candidates=reader.texts) if call is root else combined
                    )
                except ReducerParseError:
                    unread = [c.parse_error for i in call.inputs for c in reader.judges
                              if c.path == i.path and c.parse_error]  # fmt: skip
                    if not unread or any(p is not None for p in partials):
                        raise
                    # nothing to combine: say why, from the judges below (their output, what the reducer wanted)
                    error = ReducerParseError(
                        f"{call.path}: no verdict: none of the {len(partials)} judges below gave an answer the "
                        f"{r.name} reducer can read; the first: {unread[0]}"
                    )
                    error.path, error.output = call.path, ""  # type: ignore[attr-defined]  # as parse_error's
                    raise error from None
            elif call.path in reader.leaves:
                call.parsed = r.read_leaf(call.output, path=call.path, shown=reader.leaves[call.path])
            else:
                call.parsed = r.parse(call.output, path=call.path, candidates=reader.texts)
        except ReducerParseError as e:
            call.parse_error = str(e)
            if call is root:
                root_error = e
    result = JudgeResult(
        verdict=root.parsed,
        reducer=r.name,
        k=k,
        combine=mode if len(levels) > 1 or root.kind == "code" else None,
        candidates=reader.texts,
        levels=levels,
        calls=run.calls,
        metrics=_metrics(levels, run),
        tree=run.tree,
        plan=plan,
    )
    if root_error is not None:
        root_error.result = result  # type: ignore[attr-defined]  # the levels, for a fallback of your own
        raise root_error
    return result


def judge(
    candidates: Sequence[Candidate],
    instruction: str,
    k: int | None = 2,
    reducer: Reducer | str = "extract",
    **kwargs: Any,
) -> JudgeResult:
    """Synchronous `ajudge`, for scripts; also works when called from inside a running event loop."""
    return run_sync(lambda: ajudge(candidates, instruction, k, reducer, **kwargs), name="spanq-judge")
