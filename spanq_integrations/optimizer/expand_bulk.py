"""Bulk expansion: `Repeat(n, g)` becomes a `Plus` of n copies of `g`; `Map(inputs)` a `Plus` of one `Generate`
per input (a `User` message), with the map's settings. Both are order-free batches of independent calls."""

from __future__ import annotations

from ..ir import Generate, Map, Node, Plus, Repeat, User, transform
from .context import OptimizerContext

__all__ = ["expand_bulk"]


def expand_bulk(node: Node, ctx: OptimizerContext) -> Node:
    """Replace every `Repeat` and `Map` by the `Plus` of generate calls it stands for."""
    return transform(node, _expand)


def _expand(node: Node) -> Node:
    if isinstance(node, Repeat):
        # distinct (equal) objects, so nothing downstream can mistake the n calls for one
        return Plus(children=tuple(node.query.model_copy() for _ in range(node.n)))
    if isinstance(node, Map):
        return Plus(
            children=tuple(
                Generate(
                    input=User(text=text),
                    model=node.model,
                    max_tokens=node.max_tokens,
                    temperature=node.temperature,
                )
                for text in node.inputs
            )
        )
    return node
