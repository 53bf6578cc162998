"""The span-query optimizer: rewrite rules applied until nothing changes, as in SQLGlot's optimizer.

Each rule is a pure function `rule(node, ctx) -> node` in its own module, tested on its own. `optimize` applies
a list of rules (by default `DEFAULT_RULES`, in order) pass after pass until a pass changes nothing. Rules
never rewrite an `Assistant`'s `source`: it records a call that already ran.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from spanq_integrations.optimizer.bulk_order import bulk_order
from spanq_integrations.optimizer.context import (
    DEFAULT_CAPABILITIES,
    BackendCapabilities,
    OptimizerContext,
    Retriever,
    TreeReduction,
)
from spanq_integrations.optimizer.desugar_chat import desugar_chat
from spanq_integrations.optimizer.desugar_retrieve import desugar_retrieve
from spanq_integrations.optimizer.distribute_plus import distribute_plus
from spanq_integrations.optimizer.expand_bulk import expand_bulk
from spanq_integrations.optimizer.simplify_plus import simplify_plus
from spanq_integrations.optimizer.tree_reduce import tree_reduce
from spanq_integrations.query.errors import OptimizerError
from spanq_integrations.query.ir import Node

__all__ = [
    "DEFAULT_RULES",
    "MAX_PASSES",
    "OptimizerContext",
    "Retriever",
    "Rule",
    "TreeReduction",
    "apply_rules",
    "bulk_order",
    "desugar_chat",
    "desugar_retrieve",
    "distribute_plus",
    "expand_bulk",
    "optimize",
    "simplify_plus",
    "tree_reduce",
]

Rule = Callable[[Node, OptimizerContext], Node]

DEFAULT_RULES: tuple[Rule, ...] = (
    desugar_chat,
    desugar_retrieve,
    expand_bulk,
    simplify_plus,
    distribute_plus,
    tree_reduce,
    bulk_order,
)
"""Every rule, in the order a pass applies them; tree reduction and bulk ordering act only when opted in."""

MAX_PASSES = 32


def _retrievers(retrievers: Mapping[str, Retriever] | None) -> dict[str, Retriever]:
    """The retrievers by name; anything else (a list of functions, one function) refused, saying the shape."""
    if retrievers is None:
        return {}
    if not isinstance(retrievers, Mapping) or not all(isinstance(k, str) and callable(f) for k, f in retrievers.items()):
        raise OptimizerError(f"retrievers must be a dict of names to functions, as {{'default': fn}} where "
                             f"fn(query, k) returns the documents; got {type(retrievers).__name__}")
    return dict(retrievers)


def optimize(
    query: Node,
    capabilities: BackendCapabilities | None = None,
    *,
    rules: Sequence[Rule] | None = None,
    retrievers: Mapping[str, Retriever] | None = None,
    tree_reduction: TreeReduction | int | None = None,
    bulk_order: bool = False,
    max_passes: int = MAX_PASSES,
) -> Node:
    """The query rewritten for a backend with `capabilities` (default: an ordinary, span-unaware server).

    `retrievers` are the retrievers `Retrieve` nodes may name; `tree_reduction` (a `TreeReduction`, or a fan-in
    k for a tree of model calls) turns wide judges into trees; `bulk_order` reorders a top-level batch for cache
    reuse. See `OptimizerContext`.
    """
    ctx = OptimizerContext(
        capabilities=capabilities or DEFAULT_CAPABILITIES,
        retrievers=_retrievers(retrievers),
        tree_reduction=TreeReduction.of(tree_reduction),
        bulk_order=bulk_order,
    )
    return apply_rules(query, ctx, DEFAULT_RULES if rules is None else rules, max_passes=max_passes)


def apply_rules(
    query: Node, ctx: OptimizerContext, rules: Sequence[Rule], *, max_passes: int = MAX_PASSES
) -> Node:
    """Apply `rules` in order, pass after pass, until a pass changes nothing; at most `max_passes` passes."""
    current = query
    for _ in range(max_passes):
        rewritten = current
        for rule in rules:
            rewritten = rule(rewritten, ctx)
        if rewritten == current:
            return current
        current = rewritten
    names = ", ".join(getattr(rule, "__name__", repr(rule)) for rule in rules)
    raise OptimizerError(
        f"the optimizer did not settle after {max_passes} passes (rules: {names}): some rule keeps rewriting "
        "its own output; this is a bug in that rule, please report it with the query"
    )
