"""Bulk span queries on Ray Data: a large batch run over a pool of span engines, each a Ray Data actor.

    for item in run_bulk(queries, actors=2, model="tiny"):     # input order, as results arrive
        print(item.index, item.answer or item.error)

The batch is split into groups of queries that share fragments (`optimizer.bulk_order.partition_by_fragments`),
one group per Ray Data row, and `map_batches` runs the rows on an actor pool (`BulkEngine`: one embedded span
engine per actor, started once): a group runs on one engine, so its shared documents are prepared there once.
Results come back in input order: an item is yielded as soon as it and every item before it are done (a
group's items arrive together; more groups than actors, `partitions=`, streams sooner at some cost in reuse).
A query that fails is an item with its index and the error; the others complete.

Runs on a local Ray (the default: a fresh one for this process) or an existing cluster (`address=`, e.g.
`ray://head:10001`), whose nodes need spanq with the backend and cluster extras.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from spanq_integrations.optimizer.bulk_order import partition_by_fragments
from spanq_integrations.query.ir import Node
from spanq_integrations.query.spnl_json import from_json, to_json

__all__ = ["BulkEngine", "BulkItem", "run_bulk"]


@dataclass
class BulkItem:
    """One query's outcome: its index in the batch, and its answer and metrics, or the error that stopped it."""

    index: int
    answer: str = ""
    tree: dict[str, Any] | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    partition: int = -1

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "partition": self.partition}
        if self.error is not None:
            out["error"] = self.error
        else:
            out.update(answer=self.answer, usage=self.usage, calls=self.calls)
        return out


class BulkEngine:
    """A Ray Data actor: one embedded span engine; each batch row is a group of queries, run in order.

    Its cold documents are prepared alone first (`cold_spans="isolate"`), whatever their size: the batch was split
    so that the queries of a group share documents, so each is read again soon, and an answer must not depend on
    which query of its group came first (a stock-style in-context first answer would)."""

    def __init__(self, model: str = "default"):
        from spanq_backend.serving.embedded import EmbeddedBackend

        self.backend = EmbeddedBackend(model, cold_spans="isolate")

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        from spanq_integrations.runtime.executor import execute

        results: list[str] = []
        for part, group in zip(batch["partition"], batch["queries"]):
            for index, doc in json.loads(group):
                item = BulkItem(index=index, partition=int(part))
                try:
                    result = execute(from_json(doc), backend=self.backend)
                except Exception as e:  # noqa: BLE001 - a failed query is reported with its index; the rest run
                    item.error = f"{type(e).__name__}: {e}"
                else:
                    item.answer = result.answer
                    item.tree = to_json(result.tree)
                    item.calls = [c.model_dump() for c in result.calls]
                    item.usage = result.usage.openai()
                results.append(json.dumps(asdict(item)))
        return {"result": results}


def run_bulk(
    queries: Sequence[Node],
    *,
    actors: int = 2,
    model: str = "default",
    partitions: int | None = None,
    address: str | None = None,
) -> Iterator[BulkItem]:
    """Run `queries` over `actors` span engines on Ray Data; yield one `BulkItem` per query, in input order.

    Ray: the one this process is connected to, else a local one (or the cluster at `address`) joined for the
    batch and left when it ends — an idle Ray left in the process slows every engine step after it (SmolLM2's
    decode by 1.2-1.3x on this 2-core machine: `scripts/idle_cost.py ray`)."""
    if actors < 1:
        raise ValueError(f"actors must be at least 1, got {actors}")
    if not queries:
        return
    import ray

    from spanq_backend.cluster.connect import connect

    groups = partition_by_fragments(queries, partitions or actors)
    started = not ray.is_initialized()
    if started:
        connect(address)
    try:
        yield from _run_groups(queries, groups, actors, model, quiet=started)
    finally:
        if started:  # a Ray it started for this batch, not one the caller holds: stopped with the batch
            ray.shutdown()


def _run_groups(
    queries: Sequence[Node], groups: list[list[int]], actors: int, model: str, quiet: bool
) -> Iterator[BulkItem]:
    import ray

    ray.data.DataContext.get_current().enable_progress_bars = False  # the items are the progress
    if quiet:  # on a Ray of the batch's own (a caller's Ray keeps its logging as the caller set it)
        # (after Ray Data's first use, which sets its loggers' levels: its INFO lines of each run go; and the
        # warning that says progress bars are off)
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    rows = [
        {"partition": p, "queries": json.dumps([[i, to_json(queries[i])] for i in group])}
        for p, group in enumerate(groups)
    ]
    dataset = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        BulkEngine,
        fn_constructor_kwargs={"model": model},
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=min(actors, len(rows))),
        num_cpus=0,  # the engines use the cores; Ray's scheduler need not count them
    )
    done: dict[int, BulkItem] = {}
    following = 0
    for row in dataset.iter_rows():
        fields = json.loads(row["result"])
        done[fields["index"]] = BulkItem(**fields)
        while following in done:
            yield done.pop(following)
            following += 1
