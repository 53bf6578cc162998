"""`SpanBackend`: the client of a running `spanq serve` server, which reuses spans' KV across prompts.

Each `Generate` goes to `POST /v1/query/execute?stream=true` as a span query in spnl JSON, so the server sees
which parts of the prompt are order-free; the answer streams back as OpenAI `chat.completion.chunk` events whose
final usage also reports padded tokens and prepared spans. `execute_remote` sends a whole query instead and
lets the server run all of it.
"""

from __future__ import annotations

import time
from typing import Any

from spanq_integrations.backends._http import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_S, HTTPBackend
from spanq_integrations.backends.protocol import (
    BackendCapabilities,
    CallMetrics,
    Completion,
    ExecutionResult,
    TokenCallback,
    UnreadAnswer,
)
from spanq_integrations.query.errors import BackendError
from spanq_integrations.query.ir import Generate, Node

__all__ = ["EXECUTE_PATH", "SpanBackend"]

EXECUTE_PATH = "/v1/query/execute"  # the route of `spanq serve` (and of spnl's patched vLLM); defined once


def _metrics_from_usage(usage: dict[str, Any], **fields: Any) -> CallMetrics:
    details = usage.get("prompt_tokens_details") or {}
    return CallMetrics(
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        generated_tokens=int(usage.get("completion_tokens") or 0),
        padded_tokens=int(usage.get("padded_tokens") or 0),
        prepared_spans=int(usage.get("prepared_spans") or 0),
        prepared_tokens=int(usage.get("prepared_tokens") or 0),
        deferred_spans=int(usage.get("deferred_spans") or 0),
        fallback=usage.get("span_fallback") or None,
        **fields,
    )


class SpanBackend(HTTPBackend):
    """A client of `spanq serve` at `base_url` (with or without `/v1`); span-aware.

    `model` is used for calls that name none (the server's own default applies when neither does).
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        max_concurrency: int = 8,
        headers: dict[str, str] | None = None,
        api_key: str | None = None,
    ):
        super().__init__(
            base_url,
            timeout=timeout,
            max_retries=max_retries,
            headers=headers,
            max_concurrency=max_concurrency,
            api_key=api_key,
        )
        self.model = model or None
        self.capabilities = BackendCapabilities(
            name="span", span_aware=True, prepares_spans=True, max_concurrency=max_concurrency
        )

    def __repr__(self) -> str:
        return f"SpanBackend({self.base_url!r}, model={self.model!r})"

    def _with_default_model(self, query: Node) -> Node:
        if not self.model:
            return query
        from spanq_integrations.query.ir import transform

        def fill(node: Node) -> Node:
            if isinstance(node, Generate) and not node.model:
                return node.model_copy(update={"model": self.model})
            return node

        return transform(query, fill)

    async def generate(
        self, call: Generate, *, path: str = "$", on_token: TokenCallback | None = None
    ) -> Completion:
        from spanq_integrations.query.spnl_json import to_json

        call = self._with_default_model(call)  # type: ignore[assignment]
        result = await self._stream_chunks(
            f"{EXECUTE_PATH}?stream=true&format=spanq", to_json(call), n=call.n, on_token=on_token, model=call.model
        )
        metrics = _metrics_from_usage(
            result.usage,
            path=path,
            model=result.model or call.model,
            ttft_s=result.ttft_s,
            wall_s=result.wall_s,
        )
        return Completion(texts=result.texts, finish_reasons=result.finish_reasons, metrics=metrics)

    async def execute_remote(self, query: Node) -> ExecutionResult:
        """Send a whole query; the server optimizes and runs it. Returns what `aexecute` returns."""
        from spanq_integrations.query.spnl_json import from_json, to_json

        started = time.perf_counter()
        answer = await self._post_json(
            f"{EXECUTE_PATH}?stream=false&format=spanq", to_json(self._with_default_model(query)), model=self.model or ""
        )
        wall_s = time.perf_counter() - started
        if not isinstance(answer, dict) or "result" not in answer:
            raise BackendError(
                f"{self.base_url}{EXECUTE_PATH} answered without a result: {str(answer)[:200]!r}"
            )
        calls = [CallMetrics.model_validate(c) for c in answer.get("calls") or ()]
        if not calls and answer.get("usage"):
            calls = [_metrics_from_usage(answer["usage"], model=self.model or "", wall_s=wall_s)]
        unread = [UnreadAnswer.model_validate(u) for u in answer.get("unread") or ()]
        return ExecutionResult(
            tree=from_json(answer["result"]), calls=calls, wall_s=wall_s, plan=query, unread=unread
        )
