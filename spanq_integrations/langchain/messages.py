"""LangChain messages → a span query's input.

`SystemMessage` → `System`, `HumanMessage` → `User`, `AIMessage` → `Assistant`. A run of adjacent span blocks
inside one message (see `spans`) becomes one `plus` of `Fragment`s. Tool calls in the history are written as the
model writes them (`runtime.tools`: `{"tool_calls": [...]}`), and a `ToolMessage` is a user turn that says which
call it answers. Everything else a text model cannot take (images, audio, files) raises
`UnsupportedMessageError`.

`split_at_documents` is the other way spans arise: it finds retrieved documents verbatim in an ordinary prompt
and cuts the prompt around them, but only when that is safe (see its docstring); otherwise it says why not and
the prompt is sent as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from spanq_integrations.langchain.spans import span_marker
from spanq_integrations.query.errors import QueryValidationError
from spanq_integrations.runtime.prompt_spans import (
    PromptMessage,
    Role,
    SpanCandidate,
    SpanPiece,
    prompt_from_text,
    query_input,
    span_count,
    split_at_documents,
    with_instruction,
)
from spanq_integrations.runtime.tools import ToolCall, render_calls

__all__ = [
    "PromptMessage",
    "SpanCandidate",
    "SpanPiece",
    "UnsupportedMessageError",
    "prompt_from_messages",
    "prompt_from_text",
    "query_input",
    "span_count",
    "split_at_documents",
    "with_instruction",
]


_CHAT_ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "ai": "assistant",
}
_MEDIA_BLOCKS = {
    "image",
    "image_url",
    "audio",
    "input_audio",
    "video",
    "file",
    "document",
    "media",
    "text-plain",
}
_TOOL_BLOCKS = {
    "tool_call",
    "tool_call_chunk",
    "tool_use",
    "tool_result",
    "server_tool_call",
    "server_tool_result",
}
_SKIPPED_AI_BLOCKS = {"reasoning", "thinking", "redacted_thinking", "non_standard"}


class UnsupportedMessageError(QueryValidationError):
    """A message (or a content block) that spanq's text-only models cannot send; `path` names it."""


# --------------------------------------------------------------------------------------------- reading messages


def _role_of(message: BaseMessage, where: str) -> Role:
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, (HumanMessage, ToolMessage)):
        return "user"
    if isinstance(message, FunctionMessage):
        raise UnsupportedMessageError(
            where, "FunctionMessage (OpenAI's legacy function calling) is not supported: use tools and ToolMessage"
        )
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, ChatMessage):
        role = _CHAT_ROLES.get(message.role.lower())
        if role is None:
            raise UnsupportedMessageError(
                where, f"ChatMessage role {message.role!r} is not supported: use system, user or assistant"
            )
        return role
    raise UnsupportedMessageError(
        where,
        f"{type(message).__name__} is not supported: use SystemMessage, HumanMessage, AIMessage or ToolMessage",
    )


def _tool_call_text(message: AIMessage) -> str:
    """An AIMessage's tool calls (valid or not), written as the model writes them."""
    calls = [ToolCall(c["name"], dict(c.get("args") or {})) for c in message.tool_calls]
    calls += [ToolCall(str(c.get("name") or ""), {"raw": c.get("args")}) for c in message.invalid_tool_calls]
    return render_calls(calls) if calls else ""


def _parts_of(message: BaseMessage, role: Role, where: str) -> list[str | SpanPiece]:
    content = message.content
    if isinstance(content, str):
        return [content]
    parts: list[str | SpanPiece] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        if isinstance(block, str):
            text: str | SpanPiece = block
        elif not isinstance(block, dict):
            raise UnsupportedMessageError(
                at, f"a content block must be a str or a dict, got {type(block).__name__}"
            )
        else:
            kind = block.get("type")
            marker = span_marker(block)
            if marker is not None and role != "assistant":
                text = SpanPiece(
                    str(block.get("text") or ""), None if marker.get("id") is None else str(marker["id"])
                )
            elif kind == "text":
                text = str(block.get("text") or "")
            elif role == "assistant" and kind in _SKIPPED_AI_BLOCKS:
                continue  # the model's own reasoning in the history: not part of the conversation text
            elif kind in _TOOL_BLOCKS and role == "assistant":
                continue  # the message's `tool_calls` say the same, and are written below
            elif kind in _TOOL_BLOCKS:
                raise UnsupportedMessageError(
                    at, f"a {kind!r} block is not supported: spanq's models have no tool calling"
                )
            elif kind in _MEDIA_BLOCKS:
                raise UnsupportedMessageError(
                    at, f"a {kind!r} content block is not supported: spanq's models take text only"
                )
            else:
                raise UnsupportedMessageError(
                    at, f"content blocks of type {kind!r} are not supported (text only)"
                )
        # Adjacent text blocks read as one text, as `BaseMessage.text` reads them.
        if isinstance(text, str) and parts and isinstance(parts[-1], str):
            parts[-1] += text
        else:
            parts.append(text)
    return parts


def prompt_from_messages(messages: Sequence[BaseMessage]) -> list[PromptMessage]:
    """The prompt of a chat-model call; raises `UnsupportedMessageError` for what cannot be sent."""
    if not messages:
        raise QueryValidationError("messages", "no messages: nothing to send to the model")
    prompt = []
    names: dict[str, str] = {}  # tool call id -> tool name, from the calls seen so far
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, BaseMessage):
            raise UnsupportedMessageError(
                where, f"expected a LangChain message, got {type(message).__name__}"
            )
        role = _role_of(message, where)
        parts = _parts_of(message, role, where)
        if isinstance(message, AIMessage) and (message.tool_calls or message.invalid_tool_calls):
            parts = [*(p for p in parts if not isinstance(p, str) or p.strip()), _tool_call_text(message)]
        elif isinstance(message, ToolMessage):
            name = message.name or names.get(message.tool_call_id, "a tool")
            status = " (it failed)" if message.status == "error" else ""
            parts = [f"Result of {name}, call {message.tool_call_id}{status}:\n", *parts]
        if isinstance(message, AIMessage):
            names.update({c["id"]: c["name"] for c in message.tool_calls if c.get("id")})
        prompt.append(PromptMessage(role, parts))
    return prompt
