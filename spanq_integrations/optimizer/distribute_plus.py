"""Rule 4, plus distribution (nested generation): an outer generate reading a `plus` of inner generates.

When the executor runs an inner generate it closes it, in place, into `Assistant(text, source=inner)`: the
answer together with the call (and so the input) it came from. A span-aware backend lowers such an assistant,
when it is a child of a `plus`, as a span of the output alone anchored on the inner prompt: exactly what the
inner call already computed (its prompt laid out so the output starts on a KV block, because the executor told
it the output would be read as a span), so the outer call reuses that KV instead of recomputing it. The reuse
therefore needs no new node and no changed setting (changing an inner call's model or input would change its
answer). What it needs is the shape: each inner generate must be a *direct* child of a `plus` in the outer
input. This rule makes sure of that, for span-aware backends only (for any other backend it does nothing):

- an inner generate wrapped in single-child joins, `plus(…, cross(G), …)`, is pulled up: `plus(…, G, …)`;
- a `plus` holding inner generates inside a `plus` is spliced into it: `plus(plus(G₁, x), G₂)` →
  `plus(G₁, x, G₂)`, when both name the same anchor policy (or the inner one names none): a group with a
  policy of its own keeps it.

Inner generates themselves are moved, never changed (their inputs stay intact), and assistants that are
already closed keep their `source`. Rule 3 performs the same rewrites on the whole tree when it runs; this
rule guarantees the shape even when it runs on its own or in a custom rule list.
"""

from __future__ import annotations

from spanq_integrations.optimizer.context import OptimizerContext
from spanq_integrations.query.ir import Cross, Generate, Node, Plus, transform, with_children

__all__ = ["distribute_plus"]


def distribute_plus(node: Node, ctx: OptimizerContext) -> Node:
    """For span-aware backends: make every inner generate read through a `plus` a direct child of it."""
    if not ctx.capabilities.span_aware:
        return node
    return transform(node, _expose_in_generate)


def _expose_in_generate(node: Node) -> Node:
    if not isinstance(node, Generate):
        return node
    return with_children(node, [_expose(node.input)])


def _expose(node: Node) -> Node:
    """The input with the shape fixed in every join it reads directly (not in nested generates or monads)."""
    if not isinstance(node, (Plus, Cross)):
        return node
    children = [_expose(child) for child in node.children]
    if isinstance(node, Plus):
        exposed: list[Node] = []
        for child in children:
            if (
                isinstance(child, Plus)
                and child.anchor in (None, node.anchor)
                and child.role == node.role
                and any(isinstance(c, Generate) for c in child.children)
            ):
                exposed.extend(child.children)
            else:
                exposed.append(_unwrap_single_generate(child))
        children = exposed
    return with_children(node, children)


def _unwrap_single_generate(node: Node) -> Node:
    """`G` for `cross(G)`, `plus(cross(G))` and the like; any other node unchanged."""
    inner = node
    while isinstance(inner, (Plus, Cross)) and len(inner.children) == 1:
        inner = inner.children[0]
    return inner if isinstance(inner, Generate) else node
