"""Rule 2, retrieval desugaring: `Retrieve(query, k, retriever)` becomes the `Plus` of the fragments that the
registered retriever returns (an empty `Plus` when it finds nothing; rule 3 then drops it).

For a span-aware backend the rule also adds *prepare* calls, as spnl does: one `Generate(fragment,
max_tokens=1, temperature=0)` per retrieved fragment, with the model of the generate that reads the fragments,
so each fragment's KV is computed on its own and in parallel, before that generate runs. They go in a monad at
the front of the reading generate's input:

    G(cross(S, retrieve(q), U))  →  G(cross(monad(plus(G₁(f₁), …, Gₖ(fₖ))), S, plus(f₁, …, fₖ), U))

The monad contributes nothing to the prompt; being the first child of the input's `cross`, it runs before the
rest of the input is closed and so before the reading call. Placing it there (rather than around the reading
generate) keeps the generate where it was, so nested generation and tree reduction still see it. A span-aware
backend prepares spans on its own as well: the prepare calls buy parallelism, not correctness. A `Retrieve`
that no generate reads gets no prepare calls. Backends whose capabilities say `prepares_spans` (spanq's own:
they prepare every span in parallel, after the reading prompt's exact anchor) get none either: a prepare call
of the fragment alone would compute its KV under another anchor, work the reading call cannot use.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import ValidationError

from spanq_integrations.optimizer.context import OptimizerContext
from spanq_integrations.query.errors import OptimizerError, SpanQueryError
from spanq_integrations.query.ir import (
    Cross,
    Fragment,
    Generate,
    Monad,
    Node,
    Plus,
    Retrieve,
    children_of,
    with_children,
)

__all__ = ["desugar_retrieve"]


def desugar_retrieve(node: Node, ctx: OptimizerContext) -> Node:
    """Replace every `Retrieve` by its fragments (and, for span-aware backends, prepare their spans)."""
    lowered, _ = _lower(node, ctx)
    return lowered


def _lower(node: Node, ctx: OptimizerContext) -> tuple[Node, list[Fragment]]:
    """The lowered node, and the fragments retrieved inside it that no generate below it reads."""
    if isinstance(node, Retrieve):
        fragments = _retrieve(node, ctx)
        return Plus(children=tuple(fragments)), fragments
    if isinstance(node, Generate):
        new_input, fragments = _lower(node.input, ctx)
        if fragments and ctx.capabilities.span_aware and not ctx.capabilities.prepares_spans:
            new_input = _with_prepare_calls(new_input, fragments, node.model)
        return with_children(node, [new_input]), []
    children = children_of(node)
    if not children:
        return node, []
    lowered = [_lower(child, ctx) for child in children]
    return with_children(node, [n for n, _ in lowered]), [f for _, fs in lowered for f in fs]


def _retrieve(node: Retrieve, ctx: OptimizerContext) -> list[Fragment]:
    retriever = ctx.retrievers.get(node.retriever)
    if retriever is None:
        registered = ", ".join(sorted(ctx.retrievers)) or "none"
        raise OptimizerError(
            f'no retriever named "{node.retriever}" is registered (registered: {registered}). From Python, pass '
            f"retrievers={{{node.retriever!r}: fn}} to execute() or optimize(), where fn(query, k) returns the "
            "documents (fragments, strings or dicts); a query for spanq run or spanq serve carries its documents "
            "as fragments of a plus instead"
        )
    try:
        results = list(retriever(node.query, node.k))
    except SpanQueryError:
        raise
    except Exception as e:
        raise OptimizerError(f'retriever "{node.retriever}" failed on {node.query!r}: {e} (a retriever is called as '
                             "fn(query, k) and returns a list of fragments, strings or dicts)") from e
    return [_as_fragment(item, node.retriever) for item in results[: node.k]]


def _as_fragment(item: object, retriever: str) -> Fragment:
    if isinstance(item, Fragment):
        return item
    if isinstance(item, str):
        return Fragment(text=item)
    if isinstance(item, Mapping):
        try:
            return Fragment.model_validate(dict(item))
        except ValidationError as e:
            raise OptimizerError(
                f'retriever "{retriever}" returned a dict that is not a fragment: {e}'
            ) from None
    raise OptimizerError(
        f'retriever "{retriever}" returned a value of type {type(item).__name__}; '
        "expected a Fragment, a string or a dict"
    )


def _with_prepare_calls(reader_input: Node, fragments: list[Fragment], model: str) -> Node:
    distinct: list[Fragment] = []
    for f in fragments:
        if f not in distinct:  # fragments hold a metadata dict, so they are compared, not hashed
            distinct.append(f)
    prepares = Monad(
        query=Plus(
            children=tuple(Generate(input=f, model=model, max_tokens=1, temperature=0.0) for f in distinct)
        )
    )
    if isinstance(reader_input, Cross):
        return reader_input.model_copy(update={"children": (prepares, *reader_input.children)})
    return Cross(children=(prepares, reader_input))
