"""`OpenAIBackend`: run span queries on any unmodified OpenAI-compatible server (vLLM, llama.cpp, Ollama, OpenAI).

Such a server knows nothing of spans: each `Generate`'s input is flattened into ordinary chat messages
(`flatten.to_chat_messages`) and sent to `/v1/chat/completions` as a stream. Tree reduction still helps there;
span-level cache reuse does not happen.
"""

from __future__ import annotations

from typing import Any

from spanq_integrations.backends._http import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_S, HTTPBackend
from spanq_integrations.backends.protocol import (
    PROVIDER_PREFIXES,
    BackendCapabilities,
    CallMetrics,
    Completion,
    TokenCallback,
    server_model_name,
)
from spanq_integrations.query.flatten import to_chat_messages
from spanq_integrations.query.ir import Generate, child_paths

__all__ = ["PROVIDER_PREFIXES", "OpenAIBackend", "server_model_name"]

class OpenAIBackend(HTTPBackend):
    """A client of an OpenAI-compatible chat-completions server.

    `base_url` may end in `/v1` or not. `model` is used for calls that name none; when neither names one, the
    first model the server lists (GET /v1/models) is used. Connection failures before any byte came back are
    retried `max_retries` times; every other failure raises a typed `BackendError`.
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        max_concurrency: int = 8,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(
            base_url,
            timeout=timeout,
            max_retries=max_retries,
            headers=headers,
            max_concurrency=max_concurrency,
            api_key=api_key,
        )
        self.model = server_model_name(model) if model else None
        self.capabilities = BackendCapabilities(
            name="openai", span_aware=False, max_concurrency=max_concurrency
        )

    def __repr__(self) -> str:
        return f"OpenAIBackend({self.base_url!r}, model={self.model!r})"

    async def model_for(self, call: Generate) -> str:
        """The model a call runs on: its own, else this backend's default, else the server's first."""
        if call.model:
            return server_model_name(call.model)
        if self.model:
            return self.model
        served = await self.served_models()
        if not served:
            from spanq_integrations.query.errors import ModelNotFoundError

            raise ModelNotFoundError(f"{self.base_url}/v1/models lists no models: name one with model=...")
        return served[0]

    def request_body(self, call: Generate, model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
        """The JSON body of the chat-completions request for `call`."""
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": call.temperature,
        }
        if call.max_tokens:
            body["max_tokens"] = call.max_tokens
        if call.n != 1:
            body["n"] = call.n
        if call.stop:
            body["stop"] = list(call.stop)
        if call.seed is not None:
            body["seed"] = call.seed
        schema = call.schema
        if schema == {}:  # any JSON object
            body["response_format"] = {"type": "json_object"}
        elif schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        return body

    async def generate(
        self, call: Generate, *, path: str = "$", on_token: TokenCallback | None = None
    ) -> Completion:
        ((input_path, _),) = child_paths(call, path)
        messages = to_chat_messages(call.input, input_path)
        model = await self.model_for(call)
        result = await self._stream_chunks(
            "/v1/chat/completions",
            self.request_body(call, model, messages),
            n=call.n,
            on_token=on_token,
            model=model,
        )
        usage = result.usage
        details = usage.get("prompt_tokens_details") or {}
        metrics = CallMetrics(
            path=path,
            model=model,
            ttft_s=result.ttft_s,
            wall_s=result.wall_s,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            cached_tokens=int(details.get("cached_tokens") or 0),
            generated_tokens=int(usage.get("completion_tokens") or 0),
        )
        metrics.fallback = plain_text_fallback(call)
        return Completion(texts=result.texts, finish_reasons=result.finish_reasons, metrics=metrics)


def plain_text_fallback(call: Generate) -> str | None:
    """What an OpenAI-compatible server did not honour of a call, said in its `fallback` (None: nothing): its spans
    go as plain text in the order given (full attention, no reuse beyond the server's own prefix cache), and the
    span settings are not read."""
    from spanq_integrations.query.ir import Plus, walk

    ignored = [name for name in ("recompute", "cold_spans") if getattr(call, name, None) is not None]
    if not any(isinstance(node, Plus) for _, node in walk(call.input)) and not ignored:
        return None
    said = "an OpenAI-compatible server: the spans were sent as plain text, in the order given"
    return said + (f" ({' and '.join(ignored)} not read)" if ignored else "")

