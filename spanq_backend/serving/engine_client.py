"""The backend `spanq serve`'s route runs queries on: span-aware generation (`SpanGenerator`) on the server's own
`AsyncLLM` engine client, with the engine's span support, model names and cache mirror."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from spanq_backend.serving.generator import ISOLATE_MIN_TOKENS, LEAD_IN_NEUTRAL, SpanGenerator, engine_error
from spanq_backend.serving.lowering import DEFAULT_ANCHOR
from spanq_backend.serving.recompute import DEFAULT_RECOMPUTE
from spanq_backend.vllm_integration.support import SpanSupport
from spanq_integrations.backends.protocol import (
    Backend,
    BackendCapabilities,
    Completion,
    TokenCallback,
    server_model_name,
)
from spanq_integrations.query.errors import BackendUnavailableError, ModelNotFoundError
from spanq_integrations.query.ir import AnchorPolicy, Chat, Generate, Map, Node, Recompute, walk

__all__ = ["DEFAULT_MAX_TOKENS", "EngineClientBackend"]

log = logging.getLogger("spanq.server")

DEFAULT_MAX_TOKENS = 256  # for a `g` with max_tokens 0 (the server's default)


class EngineClientBackend(Backend):
    """Span-aware generation on vLLM's `AsyncLLM` engine client (the engine core runs in another process).

    One per server, shared by every query the route runs.
    """

    def __init__(
        self,
        engine_client: Any,
        tokenizer: Any,
        *,
        served_model_names: Sequence[str],
        block_size: int,
        max_model_len: int | None,
        max_concurrency: int = 16,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        span_probe: Any = None,
        span_support: SpanSupport | None = None,
        default_anchor: AnchorPolicy = DEFAULT_ANCHOR,
        default_recompute: Recompute = DEFAULT_RECOMPUTE,
        default_lead_in: str = LEAD_IN_NEUTRAL,
        cold_spans: str = "auto",
        isolate_min_tokens: int = ISOLATE_MIN_TOKENS,
        read_in_context: bool = True,
        keep_span_order: bool = False,
    ):
        """`span_probe`: the engine's prefix cache as this process sees it (`cache_probe.KVEventsMirror`); a span
        whose prepare prompt it holds wholly is not prepared again. `span_support`: what the engine's
        workers said at start-up (`vllm_integration.support`); without spans, prompts go out as stock."""
        support = span_support or SpanSupport(True)
        self.engine_client = engine_client
        self.served_model_names = tuple(served_model_names)
        self.generator = SpanGenerator(
            self._stream,
            tokenizer,
            block_size=block_size,
            max_model_len=max_model_len,
            model_name=self.served_model_names[0],
            default_max_tokens=default_max_tokens,
            span_probe=span_probe if support.enabled else None,
            spans=support.enabled,
            fallback=None if support.enabled else support.reason,
            default_anchor=default_anchor,
            default_recompute=default_recompute,
            default_lead_in=default_lead_in,
            cold_spans=cold_spans,
            isolate_min_tokens=isolate_min_tokens,
            read_in_context=read_in_context,
            keep_span_order=keep_span_order,
            attention_scores=self._attention_scores,
        )
        self.capabilities = BackendCapabilities(
            name="spanq-serve",
            span_aware=True,
            prepares_spans=True,
            span_outputs=True,
            max_concurrency=max_concurrency,
        )

    def check_model(self, model: str, path: str = "$") -> None:
        """Raise `ModelNotFoundError` unless `model` is empty (the default) or a name this server serves, also after
        a provider of spnl's ("openai/tiny", "spnl/tiny": its query files name models so; the stock route of the
        same server reads them through `OpenAIBackend`, which drops the provider)."""
        if model and model not in self.served_model_names and server_model_name(model) not in self.served_model_names:
            served = ", ".join(self.served_model_names)
            raise ModelNotFoundError(
                f"{path}: model {model!r} is not served here; this server serves {served} "
                "(or leave the model empty for the default)"
            )

    def check_models(self, query: Node) -> None:
        """Check every call in `query` before anything runs."""
        for path, node in walk(query):
            if isinstance(node, (Generate, Chat, Map)):
                self.check_model(node.model, path)

    async def generate(
        self,
        call: Generate,
        *,
        path: str = "$",
        on_token: TokenCallback | None = None,
        span_output: bool = False,
    ) -> Completion:
        self.check_model(call.model, path)
        return await self.generator.generate(call, path=path, on_token=on_token, span_output=span_output)

    async def _attention_scores(self, probe_id: str) -> dict[str, Any] | None:
        """An attention probe's result, taken from the engine's workers (`attention_probe.SCORES_METHOD`)."""
        from spanq_backend.vllm_integration.attention_probe import SCORES_METHOD, combine_workers

        return combine_workers(list(await self.engine_client.collective_rpc(SCORES_METHOD, args=(probe_id,)) or ()))

    async def _stream(self, prompt_ids: list[int], params: Any) -> AsyncIterator[Any]:
        """One token request on the engine client; aborted if the stream is closed early."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        request_id = f"spanq-{uuid.uuid4().hex}"
        try:
            outputs = self.engine_client.generate(
                TokensPrompt(prompt_token_ids=prompt_ids), params, request_id
            )
            # Closing the stream early (or cancelling its reader) aborts the request and frees its blocks.
            async with aclosing(outputs):
                async for out in outputs:
                    yield out
        except EngineDeadError as e:
            raise BackendUnavailableError(f"the server's engine has stopped: {e}") from e
        except (VLLMClientError, ValueError) as e:
            raise engine_error(e) from e
