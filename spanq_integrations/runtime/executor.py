"""The async executor: runs a span query against a backend and returns the closed tree with per-call metrics.

Independent siblings (`Plus`/`par` children, the copies of a `Repeat`) run concurrently, bounded by a semaphore
on backend calls; `Cross`/`seq` children run in order. A finished `Generate` becomes an `Assistant` whose
`source` is the `Generate` it ran (with its input already closed); a `Combine` runs the judges under it and
combines their answers in code with its reducer, into an `Assistant` whose `source` is the closed `Combine`.
If any call fails, its running siblings are cancelled and awaited, and the error names the failing node's path.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from spanq_integrations.backends.protocol import (
    AnswerTokenCallback,
    Backend,
    CallMetrics,
    ExecutionResult,
    TokenCallback,
    UnreadAnswer,
    answer_of,
    bulk_generates,
)
from spanq_integrations.backends.resolve import embedded_model_named, resolve_backend, runs_embedded
from spanq_integrations.optimizer.context import TreeReduction
from spanq_integrations.query.errors import (
    GenerationError,
    QueryValidationError,
    ReducerParseError,
    SpanQueryError,
)
from spanq_integrations.query.flatten import block_text
from spanq_integrations.query.ir import (
    NODE_TYPES,
    Assistant,
    Chat,
    Combine,
    Cross,
    Fragment,
    Generate,
    Map,
    Monad,
    Node,
    Plus,
    Print,
    Repeat,
    Retrieve,
    System,
    User,
    child_paths,
    walk,
    with_children,
)
from spanq_integrations.runtime.reducers import Reducer, reducer_from_combine
from spanq_integrations.runtime.sync import run_sync

__all__ = ["ExecutionResult", "aexecute", "answer_node", "answer_of", "combine_answers", "execute", "named_models",
           "shown_texts"]  # the result model lives with the protocol


def named_models(query: Node) -> set[str]:
    """The models the calls of `query` name (a call that names none is not counted)."""
    return {node.model for _, node in walk(query) if isinstance(node, (Generate, Chat, Map))} - {""}


def _one_model(query: Node) -> str | None:
    """The model the calls of `query` name, where those that name one all name the same (a call that names none
    runs on the backend's model: the one they name)."""
    names = named_models(query)
    return next(iter(names)) if len(names) == 1 else None


def _answer(tree: Node, path: str = "$") -> tuple[str, Node] | None:
    """The path and node of the `Generate` whose output is the answer (the one `on_token` streams), or of the
    `Combine` whose combined answer is (given to `on_token` in one piece); None if no one call answers."""
    if isinstance(tree, (Generate, Combine)):
        return path, tree
    if isinstance(tree, Cross) and tree.children:
        *_, (last_path, last) = child_paths(tree, path)
        return _answer(last, last_path)
    return None


def _answer_path(tree: Node) -> str | None:
    found = _answer(tree)
    return None if found is None else found[0]


def _answer_streams(plan: Node) -> dict[str, int]:
    """The calls whose first choice streams, by path, each with the index of that choice among the query's answers
    (`ExecutionResult.answers`): every call of a bulk query (a top-level `plus` of generates: `repeat`, `map`),
    else the one that answers."""
    generates = bulk_generates(plan)
    if generates:
        streams, k = {}, 0
        for path, child in generates:
            streams[path] = k
            k += child.n
        return streams
    path = _answer_path(plan)
    return {} if path is None else {path: 0}


def answer_node(tree: Node) -> Node | None:
    """The `Generate` (or `Combine`) whose output is the query's answer; None if no one call answers."""
    found = _answer(tree)
    return None if found is None else found[1]


async def _all_or_cancel(aws: Sequence[Awaitable[Node]]) -> list[Node]:
    """Await concurrently; on the first failure cancel the others, wait for them, and raise that failure."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _answers(closed: Node, path: str) -> list[tuple[str, Node]]:
    """The answers a `Combine` combines, with their paths in the closed tree: the children of its closed `plus`
    (a generate with n > 1 gives a `plus` of its outputs, spliced in), or its one closed input."""
    if isinstance(closed, Plus):
        return [a for child_path, c in child_paths(closed, path) for a in _answers(c, child_path)]
    return [] if isinstance(closed, (Monad, Print)) else [(path, closed)]


def shown_texts(answer: Node) -> list[str]:
    """The texts a judge read: the children of the `plus` in its input (none for an answer not generated)."""
    if not (isinstance(answer, Assistant) and isinstance(answer.source, Generate)):
        return []
    inp = answer.source.input
    if isinstance(inp, Cross):
        group = next((c for c in inp.children if isinstance(c, Plus)), None)
        if group is None:  # one candidate: the optimizer dropped its plus; it is what is not a message
            return [block_text(c) for c in inp.children if not isinstance(c, (System, User, Monad, Print))]
        inp = group
    return [block_text(c) for c in inp.children] if isinstance(inp, Plus) else [block_text(inp)]


def combine_answers(
    reducer: Reducer, answers: Sequence[tuple[str, Node]], unread: list[UnreadAnswer] | None = None
) -> Any:
    """The reducer's combined result over judges' closed answers (each with its path); an answer it cannot read
    adds nothing (and is recorded in `unread`, when given)."""
    partials = []
    for path, answer in answers:
        try:
            partials.append(reducer.read_leaf(block_text(answer), path=path, shown=shown_texts(answer)))
        except ReducerParseError as e:
            partials.append(None)
            if unread is not None:
                unread.append(UnreadAnswer(path=path, error=str(e)))
    return reducer.combine(partials)


class _Run:
    def __init__(
        self,
        backend: Backend,
        limit: int,
        on_token: TokenCallback | None,
        stream_path: str | None,
        reducers: Mapping[str, Reducer],
        on_answer_token: AnswerTokenCallback | None = None,
        answer_streams: Mapping[str, int] | None = None,
    ):
        self.backend = backend
        self.reducers = reducers
        self.semaphore = asyncio.Semaphore(limit)
        self.on_token = on_token
        self.stream_path = stream_path
        self.on_answer_token = on_answer_token
        self.answer_streams = answer_streams or {}
        self.calls: list[CallMetrics] = []
        self.unread: list[UnreadAnswer] = []

    async def eval(self, node: Node, path: str, in_input: bool = False) -> Node:
        """`in_input`: `node` is read by an outer generate (part of its input), so the generates of its
        `plus`es are read as spans."""
        evaluate = _EVALUATORS.get(type(node))
        if evaluate is None:
            raise QueryValidationError(path, f"cannot execute {type(node).__name__}")
        return await evaluate(self, node, path, in_input)

    async def _as_is(self, node: Node, path: str, in_input: bool) -> Node:
        return node

    async def _print(self, node: Print, path: str, in_input: bool) -> Node:
        print(node.text, flush=True)
        return node

    async def _in_order(self, node: Node, path: str, in_input: bool) -> Node:
        """A `cross`: each child after the one before it (a child may print, or be an effect)."""
        out = [await self.eval(child, child_path, in_input) for child_path, child in child_paths(node, path)]
        return with_children(node, out)

    async def _concurrently(self, node: Plus, path: str, in_input: bool) -> Node:
        """A `plus`: its children at once; a generate read by an outer one is laid out as a span."""
        out = await _all_or_cancel(
            [
                self.call(child, child_path, span_output=True)
                if in_input and isinstance(child, Generate)
                else self.eval(child, child_path, in_input)
                for child_path, child in child_paths(node, path)
            ]
        )
        return with_children(node, out)

    async def _effect(self, node: Monad, path: str, in_input: bool) -> Node:
        """A `monad`: its query runs for its effect; nothing reads it."""
        ((child_path, child),) = child_paths(node, path)
        return with_children(node, [await self.eval(child, child_path)])

    async def _bulk(self, node: Repeat | Map, path: str, in_input: bool) -> Node:
        calls = [self.call(g, f"{path}.{node.kind}[{i}]", span_output=in_input) for i, g in enumerate(node.expand())]
        return Plus(children=tuple(await _all_or_cancel(calls)))

    async def _generate(self, node: Generate, path: str, in_input: bool) -> Node:
        return await self.call(node, path)

    async def _combine(self, node: Combine, path: str, in_input: bool) -> Node:
        reducer = reducer_from_combine(node.reducer, node.options, path, self.reducers)
        ((input_path, inp),) = child_paths(node, path)
        closed = await self.eval(inp, input_path)  # read by code, not by a generate
        combined = combine_answers(reducer, _answers(closed, input_path), self.unread)
        text = reducer.render(combined)
        streaming = self.streaming(path)
        if streaming is not None and text:
            maybe = streaming(text)
            if inspect.isawaitable(maybe):
                await maybe
        return Assistant(text=text, source=with_children(node, [closed]))  # type: ignore[arg-type]

    async def _sugar(self, node: Chat | Retrieve, path: str, in_input: bool) -> Node:
        raise QueryValidationError(path, f"{node.kind!r} is sugar: run the optimizer first (optimize=True)")

    def streaming(self, path: str) -> TokenCallback | None:
        """What the text of the call at `path` streams to (`on_token`: the answer's; `on_answer_token`: each of a
        bulk query's answers, by index), or None."""
        targets: list[Callable[[str], Any]] = []
        if path == self.stream_path and self.on_token is not None:
            targets.append(self.on_token)
        index = self.answer_streams.get(path)
        if index is not None and self.on_answer_token is not None:
            targets.append(functools.partial(self.on_answer_token, index))
        if len(targets) < 2:
            return targets[0] if targets else None  # (as the caller gave it: a backend awaits what it returns)

        async def stream(piece: str) -> None:
            for target in targets:
                maybe = target(piece)
                if inspect.isawaitable(maybe):
                    await maybe

        return stream

    async def call(self, g: Generate, path: str, span_output: bool = False) -> Node:
        ((input_path, inp),) = child_paths(g, path)
        closed = with_children(g, [await self.eval(inp, input_path, in_input=True)])
        on_token = self.streaming(path)
        extra = {"span_output": True} if span_output and self.backend.capabilities.span_outputs else {}
        async with self.semaphore:
            try:
                completion = await self.backend.generate(closed, path=path, on_token=on_token, **extra)
            except SpanQueryError as e:
                if getattr(e, "path", None) is None and not isinstance(e, GenerationError):
                    e.path = path + getattr(e, "field", "")  # type: ignore[attr-defined]
                    e.args = (f"{e.path}: {e}",)  # type: ignore[attr-defined]
                raise
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception as e:
                raise GenerationError(path, e) from e
        metrics = completion.metrics.model_copy(
            update={"path": path, "choices": list(completion.texts), "finish_reasons": list(completion.finish_reasons)}
        )
        self.calls.append(metrics)
        outs = [Assistant(text=t, source=closed) for t in completion.texts]
        return outs[0] if len(outs) == 1 else Plus(children=tuple(outs))


_EVALUATORS: dict[type, Callable[[_Run, Any, str, bool], Awaitable[Node]]] = {
    System: _Run._as_is,
    User: _Run._as_is,
    Assistant: _Run._as_is,
    Fragment: _Run._as_is,
    Print: _Run._print,
    Cross: _Run._in_order,
    Plus: _Run._concurrently,
    Monad: _Run._effect,
    Repeat: _Run._bulk,
    Map: _Run._bulk,
    Generate: _Run._generate,
    Combine: _Run._combine,
    Chat: _Run._sugar,
    Retrieve: _Run._sugar,
}
"""How the executor runs each node class."""


def runs_anything(query: Node) -> bool:
    """Whether running `query` does anything: a model call (generate, chat, map) or a print in it."""
    return any(isinstance(node, (Generate, Chat, Map, Print)) for _, node in walk(query))


def _check_runnable(query: Any) -> None:
    """A query that would run nothing is the caller's mistake, said before a backend starts: a value that is not a
    query node (a plain string), or a tree with no model call in it (its answer was "" from 0 calls)."""
    if not isinstance(query, NODE_TYPES):
        hint = " (for a question: execute(generate(user(text))))" if isinstance(query, str) else ""
        raise TypeError(f"execute takes a span query (a node such as generate(...)), not {type(query).__name__}{hint}")
    if not runs_anything(query):
        raise QueryValidationError(
            "$", "the query makes no model call (no generate, chat or map in it): there is nothing to answer; "
            "wrap its messages in generate(...)"
        )
    # A call with nothing to send is refused here, at its input, before any call runs: it failed at the backend,
    # at the path of its call (for a map's input, a node of the optimized plan the query never had), after the
    # calls and prints before it had run.
    for path, node in walk(query):
        if isinstance(node, Map):
            empty = next((i for i, text in enumerate(node.inputs) if not text), None)
            if empty is not None:
                raise QueryValidationError(f"{path}.map.inputs[{empty}]", "an empty input: nothing to send to the model")
        elif isinstance(node, Generate) and not _says_something(node.input):
            ((input_path, _),) = child_paths(node, path)
            raise QueryValidationError(input_path, "the generate's input is empty: nothing to send to the model")


def _says_something(node: Node) -> bool:
    """Whether a call's input has text in it, or a call whose answer it will hold."""
    return any(
        isinstance(n, (Generate, Combine, Chat, Map, Repeat, Retrieve))
        or (isinstance(n, (System, User, Assistant, Fragment)) and n.text)
        for _, n in walk(node)
    )


async def aexecute(
    query: Node,
    backend: Backend | str | None = None,
    *,
    optimize: bool = True,
    retrievers: Mapping[str, Callable[..., Any]] | None = None,
    tree_reduction: TreeReduction | int | None = None,
    max_concurrency: int | None = None,
    on_token: TokenCallback | None = None,
    reducers: Mapping[str, Reducer] | None = None,
    on_answer_token: AnswerTokenCallback | None = None,
    api_key: str | None = None,
) -> ExecutionResult:
    """Run `query` on `backend` (a `Backend`, a URL, or None for the embedded default).

    `optimize` applies the optimizer for this backend's capabilities first; `tree_reduction` (a
    `TreeReduction`, or a fan-in k for a tree of model calls) turns wide judges into trees; `on_token` receives
    the answer's text as it streams; `on_answer_token(index, text)` each answer's, with its index in `answers`
    (a bulk query's answers at once: of each call, its first choice; else the answer, index 0); `reducers` are the reducer instances `Combine` nodes may name (by default
    the built-in ones, built from the node's options). `max_concurrency`: calls in flight at once (None: the
    backend's own limit). `api_key`: the bearer token a URL backend sends (default: `$SPANQ_API_KEY`, if set).
    """
    _check_runnable(query)
    if max_concurrency is not None and (isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
                                        or max_concurrency < 1):
        raise QueryValidationError("execute(max_concurrency)", "calls in flight at once: a whole number from 1 (None: "
                                   f"the backend's limit), got {max_concurrency!r}")  # (0 and -1 ran as its limit and 1)
    # (the query's calls are read for a model name only where the embedded engine runs it: not on a server's path)
    named = embedded_model_named(backend, _one_model(query)) if runs_embedded(backend) else None
    be, owned = resolve_backend(backend, named, api_key=api_key)
    try:
        plan = query
        if optimize:
            from spanq_integrations.optimizer import optimize as run_optimizer

            plan = run_optimizer(
                query,
                be.capabilities,
                retrievers=retrievers,
                tree_reduction=tree_reduction,
            )
        limit = max_concurrency or be.capabilities.max_concurrency
        run = _Run(be, max(1, limit), on_token, _answer_path(plan), dict(reducers or {}), on_answer_token,
                   _answer_streams(plan))
        t0 = time.perf_counter()
        tree = await run.eval(plan, "$")
        return ExecutionResult(
            tree=tree, calls=run.calls, wall_s=time.perf_counter() - t0, plan=plan, answer_path=run.stream_path,
            unread=run.unread,
        )
    finally:
        if owned:
            await be.aclose()


def execute(query: Node, backend: Backend | str | None = None, **kwargs: Any) -> ExecutionResult:
    """Synchronous `aexecute`, for scripts; also works when called from inside a running event loop."""
    return run_sync(lambda: aexecute(query, backend, **kwargs), name="spanq-execute")
