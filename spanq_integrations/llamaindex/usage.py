"""What a span-query run cost, as a plain dict for LlamaIndex's `metadata` / `additional_kwargs` fields."""

from __future__ import annotations

from typing import Any

from spanq_integrations.backends.protocol import ExecutionResult

__all__ = ["METADATA_KEY", "usage_of"]

METADATA_KEY = "spanq"
"""The key under which responses carry the run's usage (`response.metadata["spanq"]`)."""


def usage_of(result: ExecutionResult) -> dict[str, Any]:
    """Totals over the run's calls, the answer call's TTFT, and every call's own metrics.

    `ttft_s` is the time to the first token of the answer (the last call, the one that streams);
    `cached_tokens` counts prompt tokens read from the KV cache instead of being computed.
    """
    calls = result.calls
    answer = next((c for c in calls if c.path == "$"), calls[-1] if calls else None)
    return {
        **result.usage.model_dump(),
        "ttft_s": answer.ttft_s if answer is not None else None,
        "wall_s": result.wall_s,
        "model": answer.model if answer is not None else "",
        "per_call": [c.model_dump() for c in calls],
    }
