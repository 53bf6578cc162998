"""What the optimizer rules may consult besides the tree: the backend's capabilities, retrievers and opt-ins."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..backends.base import BackendCapabilities
from ..errors import OptimizerError
from ..ir import Fragment

__all__ = ["DEFAULT_CAPABILITIES", "OptimizerContext", "Retriever"]

Retriever = Callable[[str, int], Sequence[Fragment | str | Mapping[str, Any]]]
"""`retriever(query, k)` → up to `k` fragments: `Fragment`s, plain texts, or dicts of `Fragment` fields."""

DEFAULT_CAPABILITIES = BackendCapabilities(name="generic", span_aware=False)
"""What the optimizer assumes when no backend is named: an ordinary server that knows nothing of spans."""


@dataclass(frozen=True)
class OptimizerContext:
    """Everything a rule may consult besides the tree. Rules read it; none changes it.

    - `capabilities`: the backend the query will run on; rules 2 and 4 plan differently for span-aware ones.
    - `retrievers`: the retrievers a `Retrieve` node may name, by name.
    - `tree_reduction_k`: the fan-in of tree reduction (>= 2), or None to leave wide judges as they are.
    - `tree_reduction_instruction`: the user instruction of the intermediate judges of tree reduction; None
      gives them the query's own instruction (whatever follows the candidates).
    - `bulk_order`: reorder a top-level batch so queries that share fragments run close together.
    """

    capabilities: BackendCapabilities = DEFAULT_CAPABILITIES
    retrievers: Mapping[str, Retriever] = field(default_factory=dict)
    tree_reduction_k: int | None = None
    tree_reduction_instruction: str | None = None
    bulk_order: bool = False

    def __post_init__(self) -> None:
        k = self.tree_reduction_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 2):
            raise OptimizerError(
                f"tree_reduction_k must be an integer >= 2 (each judge reads k candidates), got {k!r}; "
                "pass None to turn tree reduction off"
            )
