"""Bulk expansion: `Repeat(n, g)` becomes a `Plus` of n copies of `g`; `Map(inputs)` a `Plus` of one `Generate`
per input (a `User` message), with the map's settings. Both are order-free batches of independent calls."""

from __future__ import annotations

from spanq_integrations.optimizer.context import OptimizerContext
from spanq_integrations.query.ir import Map, Node, Plus, Repeat, transform

__all__ = ["expand_bulk"]


def expand_bulk(node: Node, ctx: OptimizerContext) -> Node:
    """Replace every `Repeat` and `Map` by the `Plus` of generate calls it stands for."""
    return transform(node, _expand)


def _expand(node: Node) -> Node:
    if isinstance(node, (Repeat, Map)):
        return Plus(children=node.expand())
    return node
