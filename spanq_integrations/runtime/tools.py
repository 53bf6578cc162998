"""Tool calling on any model spanq runs: the tools in the prompt, the answer constrained to a JSON schema.

A call with tools asks for a JSON answer: `{"tool_calls": [{"name": ..., "arguments": {...}}]}` to call tools,
or `{"answer": "..."}` to answer in text (when the tool choice lets it). The schema (`reply_schema`) is enforced
by constrained decoding (vLLM's structured outputs on the embedded engine and on `spanq serve`; `response_format`
on OpenAI-compatible servers), so even a small model writes a call with the tool's exact name and arguments of
the declared types; the tools' descriptions go in the prompt (`tools_instruction`). `read_reply` turns the answer
back into text and calls, and says what is wrong with an answer it cannot read (cut off by `max_tokens`).

Both adapters use it: LangChain's `ChatSpanQuery.bind_tools` / `with_structured_output` and LlamaIndex's
`SpanQueryLLM` (a function-calling LLM).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from spanq_integrations.query.errors import QueryValidationError

__all__ = ["ToolCall", "ToolChoice", "ToolReply", "ToolSpec", "read_reply", "reply_schema", "tools_instruction"]

ToolChoice = Literal["auto", "required", "none"] | str  # or the name of the one tool to call


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the model sees it: its name, what it does, and its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    @classmethod
    def from_openai(cls, tool: dict[str, Any]) -> ToolSpec:
        """From OpenAI's tool format (`{"type": "function", "function": {"name", "description", "parameters"}}`)."""
        fn = tool.get("function", tool)
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise QueryValidationError("tools", f"a tool needs a name, got {fn!r:.80}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise QueryValidationError("tools", f"tool {name!r}: its parameters must be a JSON schema of an object")
        return cls(name, str(fn.get("description") or ""), params)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolReply:
    """What the model answered: text, tool calls, or why its answer could not be read (`error`)."""

    text: str = ""
    calls: tuple[ToolCall, ...] = ()
    error: str | None = None
    raw: str = ""


def check_choice(tools: Sequence[ToolSpec], choice: ToolChoice | None) -> ToolChoice:
    """The tool choice, checked against the tools: "auto" (default), "required", "none", or a tool's name."""
    if choice is None:
        return "auto"
    if choice in ("auto", "required", "none"):
        return choice
    names = [t.name for t in tools]
    if choice not in names:
        raise QueryValidationError(
            "tool_choice", f"tool_choice {choice!r} names no bound tool (tools: {', '.join(names) or 'none'})"
        )
    return choice


def _arguments_schema(tool: ToolSpec) -> dict[str, Any]:
    params = dict(tool.parameters)
    params.setdefault("type", "object")
    params.setdefault("properties", {})
    return params


def reply_schema(tools: Sequence[ToolSpec], choice: ToolChoice = "auto", *, parallel: bool = False) -> dict[str, Any]:
    """The JSON schema of the answer. `parallel=False` (the default): at most one call per answer."""
    if not tools:
        raise QueryValidationError("tools", "no tools: bind at least one, or call the model without tools")
    chosen = [t for t in tools if choice in ("auto", "required") or t.name == choice]
    one = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": _arguments_schema(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    calls: dict[str, Any] = {"type": "array", "items": one[0] if len(one) == 1 else {"anyOf": one}, "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    with_calls = {
        "type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"], "additionalProperties": False,
    }
    if choice != "auto":
        return with_calls
    text = {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
        "additionalProperties": False,
    }
    return {"anyOf": [with_calls, text]}


def tools_instruction(tools: Sequence[ToolSpec], choice: ToolChoice = "auto") -> str:
    """The system text that shows the model its tools and the answer's form."""
    lines = ["You can call tools. Answer with JSON only."]
    if choice == "auto":
        lines.append('To call a tool: {"tool_calls": [{"name": "<tool>", "arguments": {...}}]}. To answer '
                     'without a tool: {"answer": "<text>"}.')
    else:
        target = "a tool" if choice == "required" else f"the tool {choice}"
        lines.append(f'Call {target}: {{"tool_calls": [{{"name": "<tool>", "arguments": {{...}}}}]}}.')
    lines.append("Tools:")
    for t in tools:
        if choice not in ("auto", "required") and t.name != choice:
            continue
        desc = f": {t.description}" if t.description else ""
        lines.append(f"- {t.name}{desc} Arguments: {json.dumps(_arguments_schema(t).get('properties', {}))}")
    return "\n".join(lines)


def render_calls(calls: Sequence[ToolCall]) -> str:
    """Tool calls in the history, written as the model writes them."""
    return json.dumps({"tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls]})


def read_reply(text: str, tools: Sequence[ToolSpec]) -> ToolReply:
    """The model's JSON answer as text and tool calls; `error` says why it could not be read."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return ToolReply(error=f"the answer is not complete JSON ({e}); raise max_tokens", raw=text)
    if not isinstance(value, dict):
        return ToolReply(error="the answer is not a JSON object", raw=text)
    if "answer" in value:
        return ToolReply(text=str(value["answer"]), raw=text)
    known = {t.name for t in tools}
    calls = []
    for i, item in enumerate(value.get("tool_calls") or []):
        if not isinstance(item, dict) or item.get("name") not in known or not isinstance(item.get("arguments"), dict):
            return ToolReply(error=f"tool call {i} is not a call of a bound tool: {item!r:.120}", raw=text)
        calls.append(ToolCall(item["name"], item["arguments"]))
    if not calls:
        return ToolReply(error="the answer has neither tool calls nor an answer", raw=text)
    return ToolReply(calls=tuple(calls), raw=text)
