"""Size limits of a query, checked before any work starts (a server must not be taken down by one request).

A span query is a tree a client writes: nothing in its grammar stops `"n": 1000000000` or a million-deep
nesting, and either would exhaust a server's memory or stack long before a model ran. `QueryLimits` bounds
what one query may ask for; `check_limits` walks the tree once, without recursion, and raises
`QueryLimitError` (a `QueryValidationError`, HTTP 400) naming the limit, the path and how to raise it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from spanq_integrations.query.errors import QueryValidationError
from spanq_integrations.query.ir import (
    Assistant,
    Chat,
    Fragment,
    Generate,
    Map,
    Node,
    Plus,
    Repeat,
    Retrieve,
    System,
    User,
    child_paths,
)

__all__ = ["DEFAULT_LIMITS", "QueryLimitError", "QueryLimits", "check_json_depth", "check_limits"]


class QueryLimitError(QueryValidationError):
    """A query asks for more than the server allows (`QueryLimits`)."""


@dataclass(frozen=True)
class QueryLimits:
    """What one query may ask for. `spanq serve` takes each as `--max-...` (for example `--max-n 64`)."""

    max_body_bytes: int = field(default=8 << 20, metadata={"help": "bytes of the request body, before it is parsed"})
    max_depth: int = field(default=64, metadata={"help": "nesting of query nodes"})
    max_n: int = field(default=16, metadata={"help": "choices of one generate call (n)"})
    max_bulk: int = field(default=256, metadata={"help": "copies of a repeat, inputs of a map"})
    max_calls: int = field(
        default=1024, metadata={"help": "generate calls in the whole query, choices and bulk copies included"}
    )
    max_fragments: int = field(
        default=512, metadata={"help": "spans in the whole query: fragments, retrieved ones (k each), a plus's messages"}
    )

    def describe(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def meaning(name: str) -> str:
        """What the limit `name` bounds, in words (`spanq serve --help`)."""
        return next(f.metadata["help"] for f in fields(QueryLimits) if f.name == name)


DEFAULT_LIMITS = QueryLimits()
MAX_JSON_CONTAINERS = 4 << 16  # objects and arrays in one document (a query node is one to three of them)


def _fail(limit: str, value: int, allowed: int, path: str, what: str) -> QueryLimitError:
    flag = "--" + limit.replace("_", "-")
    return QueryLimitError(path, f"{what} is {value}, over the server's limit {limit}={allowed} (spanq serve {flag})")


def check_json_depth(doc: Any, limits: QueryLimits = DEFAULT_LIMITS) -> None:
    """Refuse a parsed JSON document nested deeper than a query may be, before it is read into nodes.

    A query node nests through an object, its body, and (for joins) an array: at most three JSON levels per node.
    The whole document is walked (it is bounded by the body's size and `MAX_JSON_CONTAINERS`), so the error names
    how deep it nests, not where the walk first passed the limit."""
    allowed = 3 * limits.max_depth + 3
    stack: list[tuple[Any, int]] = [(doc, 1)]
    containers = 0
    deepest = 0
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(value, (dict, list)):
            containers += 1
            if containers > MAX_JSON_CONTAINERS:  # before a node is built (a query's nodes are read from these)
                raise QueryLimitError("$", f"the document has over {MAX_JSON_CONTAINERS} objects and arrays, more "
                                      "than a query of at most 65536 nodes holds")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    if deepest > allowed:
        raise QueryLimitError(
            "$", f"the document nests {deepest} levels of objects and arrays, more than a query within the server's "
            f"limit max_depth={limits.max_depth} can ({allowed}: three a node) (spanq serve --max-depth)"
        )


def check_limits(query: Node, limits: QueryLimits = DEFAULT_LIMITS, no_retrieve: str | None = None) -> None:
    """Raise `QueryLimitError` if `query` asks for more than `limits` allow; walks the tree once, iteratively, in
    document order. A count over its limit (calls, fragments) is the whole query's, at the path where it first went
    over; the other limits are per node, at the first node over them. With `no_retrieve` (a reason: a server has no
    retriever), the first `retrieve` met is a `QueryValidationError` at its node saying so, in the same walk."""
    calls = 0
    fragments = 0
    first_over: dict[str, str] = {}  # limit -> the path where the count first went over it
    # (node, path, depth, how many times it runs: the product of the n/repeat/map counts above it)
    stack: list[tuple[Node, str, int, int]] = [(query, "$", 1, 1)]
    while stack:
        node, path, depth, runs = stack.pop()
        if depth > limits.max_depth:
            raise _fail("max_depth", depth, limits.max_depth, path, "the nesting of query nodes")
        if isinstance(node, Generate):
            if node.n > limits.max_n:
                raise _fail("max_n", node.n, limits.max_n, f"{path}.{node.tag}.n", "the number of choices")
            runs *= node.n
            calls += runs
        elif isinstance(node, Repeat):
            if node.n > limits.max_bulk:
                raise _fail("max_bulk", node.n, limits.max_bulk, f"{path}.{node.tag}.n", "the number of copies")
            runs *= node.n
        elif isinstance(node, Map):
            count = len(node.inputs)
            if not count:  # it would run nothing, and its answer (an empty plus) is no query to send back
                raise QueryValidationError(f"{path}.{node.tag}.inputs", "a map needs at least one input")
            if count > limits.max_bulk:
                raise _fail("max_bulk", count, limits.max_bulk, f"{path}.{node.tag}.inputs", "the number of inputs")
            calls += runs * count
        elif isinstance(node, Chat):  # sugar for one generate call
            calls += runs
        elif isinstance(node, Fragment):
            fragments += 1
        elif isinstance(node, Retrieve):
            if no_retrieve is not None:
                raise QueryValidationError(f"{path}.{node.tag}", no_retrieve)
            fragments += node.k
        elif isinstance(node, Plus):  # its messages are spans too (spnl writes documents so)
            fragments += sum(1 for c in node.children if isinstance(c, (User, System, Assistant)))
        if calls > limits.max_calls:
            first_over.setdefault("max_calls", path)
        if fragments > limits.max_fragments:
            first_over.setdefault("max_fragments", path)
        stack.extend((child, child_path, depth + 1, runs) for child_path, child in reversed(list(child_paths(node, path))))
    if "max_calls" in first_over:
        raise _fail("max_calls", calls, limits.max_calls, first_over["max_calls"], "the number of generate calls")
    if "max_fragments" in first_over:
        raise _fail("max_fragments", fragments, limits.max_fragments, first_over["max_fragments"],
                    "the number of fragments")  # fmt: skip
