"""The span runtime's counters of this process, read by `spanq_backend.serving.metrics` (in-process engines) and,
installed on vLLM's `WorkerBase` as `support.WORKER_STATS_METHOD`, by `spanq serve` through `collective_rpc`.
Its own module so that neither the worker's patches nor the engine core's import the package that registers
them (no import circle)."""

from __future__ import annotations

from typing import Any

from spanq_backend.vllm_integration import engine_core, tier, worker

__all__ = ["stats", "worker_span_stats"]


def stats() -> dict[str, Any]:
    """Span-runtime counters of this process (in-process engines only): moves and the host time they took,
    duplicates, conflicts, how many span runtimes run here, how many runners move keys with spanq's compiled
    CPU op (`kv.kernels.relocate_keys_op`) rather than torch, and the span tiers' counters (`tier_*`)."""
    runtimes = [s.runtime for s in worker.runner_spans.values() if s.runtime is not None]
    return {
        "runtimes": len(runtimes),
        "relocation_seconds": sum(rt.relocation_seconds for rt in runtimes),
        "moved_blocks": sum(rt.relocator.moved_blocks for rt in runtimes),
        "compiled_runners": sum(rt.relocator.uses_compiled_kernel for rt in runtimes),
        "conflicts": sum(rt.tracker.conflicts for rt in runtimes),
        "duplicates": sum(m.planner.duplicates_made for m in engine_core.manager_spans.values()),
        "worn_blocks": engine_core.WORN["blocks"],
        "hashing_seconds": engine_core.HASHING["seconds"],
        **tier.process_stats(),
    }


def worker_span_stats(_worker_base: Any) -> dict[str, Any]:
    """Installed on vLLM's `WorkerBase` as `support.WORKER_STATS_METHOD`: the span counters of this process."""
    return stats()
