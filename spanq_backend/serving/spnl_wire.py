"""spnl's own wire format on `POST /v1/query/execute`, beside spanq's richer one.

spnl's client (spnl-run's `spnl` backend, 0.22) posts a query as `text/plain` with `?stream=true|false` and reads:

- not streamed: OpenAI's `chat.completion` (one choice per answer: a `g` with `n`, a `repeat`), or its
  `text_completion` for a `map` (one choice per input);
- streamed: server-sent `data: {...}` events, each a `text_completion` chunk (`choices[].index` / `.text`, text
  appended per index), then `data: [DONE]`.

spanq's client (`SpanBackend`) asks for `format=spanq`: the closed tree, per-call metrics, and
`chat.completion.chunk` events whose final usage carries the span counters. A request that names no format gets
spnl's when its body is `text/plain` (what spnl's client sends), spanq's otherwise.
"""

from __future__ import annotations

import json
from typing import Any

from spanq_integrations.backends.protocol import ExecutionResult
from spanq_integrations.query.errors import QueryValidationError
from spanq_integrations.query.ir import Map, Node

__all__ = ["WIRE_FORMATS", "choices_of", "spnl_chunk", "spnl_response", "wire_format"]

WIRE_FORMATS = ("spanq", "spnl")
# The finish reasons spnl's client can read (async-openai's enums); vLLM's others ("abort", ...) become null.
_FINISH_REASONS = ("stop", "length")


def wire_format(requested: str | None, content_type: str | None) -> str:
    """The answer's format: `?format=` when given (a 400 naming the choices if unknown), else by the body's
    media type (`text/plain`: spnl's client)."""
    if requested is not None:
        if requested not in WIRE_FORMATS:
            raise QueryValidationError(
                "format", f"unknown answer format {requested!r} (one of: {', '.join(WIRE_FORMATS)})"
            )
        return requested
    media = (content_type or "").split(";")[0].strip().lower()
    return "spnl" if media == "text/plain" else "spanq"


def _finish(reason: str | None) -> str | None:
    return reason if reason in _FINISH_REASONS else None


def choices_of(result: ExecutionResult) -> list[tuple[str, str | None]]:
    """(text, finish reason) per answer: the answering call's choices when one call answers; the answers of a
    bulk node (a `plus` of generated messages: `repeat`, `map`, a top-level `plus` of `g`s) in order; else the
    query's answer."""
    call = result.answer_call
    if call is not None and call.choices:
        return [(text, _finish(reason)) for text, reason in zip(call.choices, call.finish_reasons)]
    bulk = result.bulk_answers
    if bulk is not None:
        return [(text, _finish(reason)) for text, reason in bulk]
    return [(result.answer, None)]


def _usage(result: ExecutionResult) -> dict[str, Any]:
    return result.usage.openai()  # OpenAI's three counts first; spnl's reader ignores spanq's extra fields


def spnl_response(
    query: Node,
    result: ExecutionResult,
    *,
    request_id: str,
    created: int,
    model: str,
) -> dict[str, Any]:
    """The non-streamed answer spnl's client reads: `text_completion` for a `map`, `chat.completion` otherwise."""
    choices = choices_of(result)
    if isinstance(query, Map):
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                for i, (text, reason) in enumerate(choices)
            ],
            "usage": _usage(result),
        }
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
            for i, (text, reason) in enumerate(choices)
        ],
        "usage": _usage(result),
    }


def spnl_chunk(
    request_id: str,
    created: int,
    model: str,
    choices: list[tuple[int, str, str | None]],
    usage: dict[str, Any] | None = None,
) -> str:
    """One server-sent `text_completion` chunk: (index, text, finish reason) per choice."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": i, "text": text, "logprobs": None, "finish_reason": reason} for i, text, reason in choices
        ],
    }
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
