"""What the optimizer rules may consult besides the tree: the backend's capabilities, retrievers and opt-ins."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from spanq_integrations.query.errors import check_fan_in
from spanq_integrations.query.ir import Fragment

__all__ = ["DEFAULT_CAPABILITIES", "BackendCapabilities", "OptimizerContext", "Retriever"]

class BackendCapabilities(BaseModel):
    """What a backend can do; the optimizer's planning input (span-aware backends get span plans)."""

    model_config = ConfigDict(frozen=True)

    name: str
    span_aware: bool = False
    prepares_spans: bool = False  # the backend puts each span in the cache itself, under the right anchor
    # `generate(..., span_output=True)` is understood: an inner generation whose output an outer generate reads
    # as a span is laid out for it (its output on a block boundary, its KV kept for the judge).
    span_outputs: bool = False
    max_concurrency: int = 8



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
    - `tree_reduction_combine`: None, model calls at every level of the tree; or the name of a reducer whose
      combine step is exact in code (`extract`, `select`, `count`, `vote`): the tree is then one level of leaf
      judges under a `Combine` node, built with `tree_reduction_combine_options`.
    - `bulk_order`: reorder a top-level batch so queries that share fragments run close together.
    """

    capabilities: BackendCapabilities = DEFAULT_CAPABILITIES
    retrievers: Mapping[str, Retriever] = field(default_factory=dict)
    tree_reduction_k: int | None = None
    tree_reduction_instruction: str | None = None
    tree_reduction_combine: str | None = None
    tree_reduction_combine_options: Mapping[str, Any] = field(default_factory=dict)
    bulk_order: bool = False

    def __post_init__(self) -> None:
        check_fan_in(self.tree_reduction_k, "tree_reduction_k", "candidates", none="to turn tree reduction off")
