"""What the optimizer rules may consult besides the tree: the backend's capabilities, retrievers and opt-ins."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from spanq_integrations.query.errors import QueryValidationError, check_fan_in
from spanq_integrations.query.ir import Fragment

__all__ = ["DEFAULT_CAPABILITIES", "BackendCapabilities", "OptimizerContext", "Retriever", "TreeReduction"]

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
class TreeReduction:
    """Tree reduction (attention locality), as one value: a judge over more than `k` candidates becomes a tree
    of judges that each read at most `k`.

    - `k`: the fan-in, at least 2.
    - `combine`: how the judges' answers are combined — `"model"`, by model calls at every level up to the
      root; `"code"`, one level of leaf judges whose answers the exact combine step of `reducer` joins in code
      (a `Combine` node: no model call above the leaves). The same word means the same in `judge(combine=)`,
      which adds `"auto"` (code where the reducer's combine is exact).
    - `instruction`: the user instruction the intermediate judges (`model`) or the leaf judges (`code`) read
      instead of the query's own; None keeps the query's own.
    - `reducer`, `options`: with `combine="code"`, the reducer (by name: `extract`, `select`, `count`, `vote`)
      and its settings (say its `item_pattern`).

    Every front door that reduces takes this value (`optimize`, `execute`, LlamaIndex's `run_query`), or an
    int `k` for a tree of model calls with the query's own instruction.
    """

    k: int
    combine: Literal["model", "code"] = "model"
    instruction: str | None = None
    reducer: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fan_in(self.k, "tree_reduction.k", "candidates")
        if self.combine not in ("model", "code"):
            raise QueryValidationError(
                "tree_reduction.combine", f"tree reduction combines by 'model' or 'code', not {self.combine!r}"
            )
        if (self.combine == "code") != (self.reducer is not None):
            raise QueryValidationError(
                "tree_reduction.reducer",
                "tree reduction combines in code with a reducer and by model calls without one (combine='code', "
                f"reducer='extract'); got combine={self.combine!r} and reducer={self.reducer!r}",
            )

    @classmethod
    def of(cls, value: TreeReduction | int | None) -> TreeReduction | None:
        """The value a front door was given: a `TreeReduction`, a fan-in `k` (model calls), or None (off)."""
        if value is None or isinstance(value, TreeReduction):
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise QueryValidationError(
                "tree_reduction", f"tree_reduction is a TreeReduction or a fan-in k (an int), not {value!r}"
            )
        return cls(k=value)


@dataclass(frozen=True)
class OptimizerContext:
    """Everything a rule may consult besides the tree. Rules read it; none changes it.

    - `capabilities`: the backend the query will run on; rules 2 and 4 plan differently for span-aware ones.
    - `retrievers`: the retrievers a `Retrieve` node may name, by name.
    - `tree_reduction`: how wide judges become trees (`TreeReduction`), or None to leave them as they are.
    - `bulk_order`: reorder a top-level batch so queries that share fragments run close together.
    """

    capabilities: BackendCapabilities = DEFAULT_CAPABILITIES
    retrievers: Mapping[str, Retriever] = field(default_factory=dict)
    tree_reduction: TreeReduction | None = None
    bulk_order: bool = False
