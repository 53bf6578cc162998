"""Whether an engine honours span tables (invariant 9 of docs/design.md: never silently wrong).

A span block found at a new position is right only once its keys are re-rotated, and only a model runner that
spanq hooks, with a relocation runtime for the loaded model, does that. So every engine asks its workers at
start-up (`WORKER_STATUS_METHOD` through vLLM's `collective_rpc`: a method name travels between processes,
a function does not) and honours span tables only if all of them say yes. Anywhere else a request with a span
table runs as a stock request, and the front end reports why (`fallback`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["STOCK", "STOCK_ENGINE_KEY", "UNCHECKED", "WORKER_STATS_METHOD", "WORKER_STATUS_METHOD", "SpanSupport", "aquery_span_support", "query_span_support", "started_stock"]

# The method the plugin adds to vLLM's workers (`worker.worker_span_status`).
WORKER_STATUS_METHOD = "spanq_span_status"
WORKER_STATS_METHOD = "spanq_span_stats"  # the span counters of a worker's process (`vllm_integration.stats`)


@dataclass(frozen=True)
class SpanSupport:
    """An engine's answer: spans on, or off and why."""

    enabled: bool
    reason: str = ""  # why not, when not
    unanswered: bool = False  # the workers could not be asked: the answer may differ when asked again

    @classmethod
    def of_workers(cls, statuses: Sequence[Sequence[Any]]) -> SpanSupport:
        """The engine's answer from every worker's `(ok, reason)`: on only if all are."""
        if not statuses:
            return cls(False, "the engine reported no workers")
        problems = [f"worker {i}: {why}" for i, (ok, why) in enumerate(statuses) if not ok]
        return cls(False, "; ".join(problems)) if problems else cls(True)


UNCHECKED = SpanSupport(False, "the engine has not checked its workers")
STOCK = SpanSupport(False, "a stock engine (spans=False)")

# In vLLM's `additional_config`: the engine was started as a stock one (`SpanEngine(spans=False)`, a benchmark's
# or the demo's baseline). Its engine core does not ask its workers (no start-up self-check) and honours no span
# table, whatever a request carries.
STOCK_ENGINE_KEY = "spanq_stock_engine"


def started_stock(vllm_config: Any) -> bool:
    """Whether the engine of `vllm_config` was started as a stock one (`STOCK_ENGINE_KEY`)."""
    return bool((getattr(vllm_config, "additional_config", None) or {}).get(STOCK_ENGINE_KEY))


def _unreachable(e: Exception) -> SpanSupport:
    return SpanSupport(
        False,
        f"the workers could not answer ({type(e).__name__}: {e}); is the spanq plugin loaded in every vLLM process?",
        unanswered=True,
    )


def query_span_support(collective_rpc: Callable[[str], Any]) -> SpanSupport:
    """Ask every worker of an engine (through its `collective_rpc`) whether it moves span keys."""
    try:
        statuses = collective_rpc(WORKER_STATUS_METHOD)
    except Exception as e:  # noqa: BLE001  (a worker without the plugin cannot answer: no spans)
        return _unreachable(e)
    return SpanSupport.of_workers(statuses)


async def aquery_span_support(collective_rpc: Callable[[str], Awaitable[Any]]) -> SpanSupport:
    """`query_span_support` for an async engine client (`AsyncLLM.collective_rpc`)."""
    try:
        statuses = await collective_rpc(WORKER_STATUS_METHOD)
    except Exception as e:  # noqa: BLE001
        return _unreachable(e)
    return SpanSupport.of_workers(statuses)
