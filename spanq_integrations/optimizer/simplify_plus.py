"""Rule 3, join simplification: flatten a `Plus` inside a `Plus` (and a `Cross` inside a `Cross` of the same
keyword), drop empty joins from their parent join, and replace a single-child join by its child (a `plus` only
where its child reads the same outside it: user text).

These keep the meaning of the query: `plus` is associative and commutative, `cross` associative. An empty join
at the root, as a generate's input or inside a monad has no parent join to leave, so it stays. For a span-aware
backend a `plus` of one document stays too: it says the document is a span, computed once and reused after any
prefix (a question over one long document, a retriever's one hit), which its bare text would not be.
"""

from __future__ import annotations

from spanq_integrations.optimizer.context import OptimizerContext
from spanq_integrations.query.ir import Cross, Fragment, Node, Plus, User, transform, with_children

__all__ = ["simplify_plus"]


def simplify_plus(node: Node, ctx: OptimizerContext) -> Node:
    """The tree with flat, non-empty, multi-child joins (a one-document `plus` kept for a span-aware backend)."""
    keep_lone_spans = ctx.capabilities.span_aware
    return transform(node, lambda n: _simplify_join(n, keep_lone_spans))


def _simplify_join(node: Node, keep_lone_spans: bool = False) -> Node:
    if not isinstance(node, (Plus, Cross)):
        return node
    children: list[Node] = []
    for child in node.children:  # already simplified: transform works bottom-up
        if isinstance(child, (Plus, Cross)) and not child.children:
            continue
        if _flattens_into(child, node):
            children.extend(child.children)  # type: ignore[union-attr]
        else:
            children.append(child)
    if len(children) == 1:
        lone = children[0]
        keep = isinstance(node, Plus) and (
            (keep_lone_spans and isinstance(lone, Fragment))
            # A `plus` child is content of the group's role (user unless it says system); out of it a generate's
            # output is an assistant turn, a system or assistant message keeps its role, a `cross` its messages'
            # roles, a fragment or text is user content: only user text in a user group reads the same.
            or (isinstance(lone, Plus) and lone.role != node.role)
            or (node.role is not None and not isinstance(lone, Plus))
            or not isinstance(lone, (Fragment, User, Plus))
        )
        if keep:
            return node if tuple(children) == node.children else with_children(node, children)
        return lone
    return with_children(node, children)


def _flattens_into(child: Node, parent: Plus | Cross) -> bool:
    if isinstance(parent, Plus):  # one group: one anchor policy, one role
        return isinstance(child, Plus) and child.anchor in (None, parent.anchor) and child.role == parent.role
    return isinstance(child, Cross) and child.keyword == parent.keyword
