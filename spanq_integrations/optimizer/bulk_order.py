"""Rule 6, bulk ordering (temporal locality): reorder a top-level batch so queries that share fragments run
close together, while the shared fragments are still in the cache. Opt-in (`bulk_order=True`).

A batch is a `plus` (or `par`) at the root of the query; its children are independent, so any order means the
same. A fragment is known by its id when it has one, else by its text. The order is greedy: start from the
query that shares the most of its fragments with the others, then repeatedly take the unvisited query with the
largest overlap with the last one taken. Ties go to the earlier query, so the order is deterministic, a batch
with nothing shared keeps its order, and ordering an ordered batch changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from spanq_integrations.optimizer.context import OptimizerContext
from spanq_integrations.query.ir import Fragment, Node, Plus, walk

__all__ = ["bulk_order", "partition_by_fragments"]

_FragmentKey = tuple[str, str]


def bulk_order(node: Node, ctx: OptimizerContext) -> Node:
    """The root batch, reordered so that queries sharing fragments are neighbours."""
    if not ctx.bulk_order or not isinstance(node, Plus) or len(node.children) < 3:  # two need no order
        return node
    keys = [_fragment_keys(child) for child in node.children]
    order = _greedy_order(keys)
    return node.model_copy(update={"children": tuple(node.children[i] for i in order)})


def _fragment_keys(node: Node) -> frozenset[_FragmentKey]:
    """The fragments a query reads, each known by its id, or its text when it has none."""
    return frozenset(
        ("id", n.id) if n.id is not None else ("text", n.text)
        for _, n in walk(node)
        if isinstance(n, Fragment)
    )


def _greedy_order(keys: list[frozenset[_FragmentKey]]) -> list[int]:
    """Indices of the queries in visiting order (see the module docstring)."""
    remaining = list(range(len(keys)))

    def shared(i: int) -> int:
        others = frozenset().union(*(keys[j] for j in remaining if j != i))
        return len(keys[i] & others)

    first = max(remaining, key=lambda i: (shared(i), -i))
    order = [first]
    remaining.remove(first)
    while remaining:
        last = keys[order[-1]]
        best = max(remaining, key=lambda i: (len(keys[i] & last), -i))
        order.append(best)
        remaining.remove(best)
    return order


def partition_by_fragments(queries: Sequence[Node], parts: int, slack: float = 1.25) -> list[list[int]]:
    """Split a batch into at most `parts` groups (query indices) so that queries sharing fragments land in the
    same group: each engine of a pool then sees its group's fragments, computed once there.

    The greedy order above, generalised: queries are taken in that order, each into the group whose fragments
    it shares most (ties: the smaller group, then the lower one), no group past `slack` times an even share, so
    the engines get comparable work. Within a group, the visiting order is kept (temporal locality). Empty
    groups are dropped; the result is deterministic.
    """
    n = len(queries)
    if n == 0:
        return []
    parts = max(1, min(parts, n))
    keys = [_fragment_keys(q) for q in queries]
    order = _greedy_order(keys) if n >= 3 else list(range(n))
    cap = max(1, -(-int(n * slack) // parts))
    groups: list[list[int]] = [[] for _ in range(parts)]
    seen: list[set[_FragmentKey]] = [set() for _ in range(parts)]
    for i in order:
        open_groups = [g for g in range(parts) if len(groups[g]) < cap] or list(range(parts))
        best = max(open_groups, key=lambda g: (len(keys[i] & seen[g]), -len(groups[g]), -g))
        groups[best].append(i)
        seen[best] |= keys[i]
    return [g for g in groups if g]
