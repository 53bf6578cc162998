"""Flatten a closed `Generate` input into ordinary chat messages, for servers that know nothing of spans.

Layout (what an unmodified OpenAI-compatible server receives):
- `System`, `User`, `Assistant` children of a `Cross` keep their roles, in order.
- A `Fragment` outside any `Plus` is user content.
- A `Plus` becomes user content: its children in the order given, each one its own text block, blocks separated
  by a blank line. A generated `Assistant` inside a `Plus` (a candidate to judge) is content there, not an
  assistant turn. Nothing marks the blocks as order-free: such a server cannot use that fact.
- Adjacent pieces of the same role merge into one message (blocks joined by a blank line), so the conversation
  alternates as chat templates expect.
"""

from __future__ import annotations

from spanq_integrations.query.errors import QueryValidationError
from spanq_integrations.query.ir import (
    Assistant,
    Combine,
    Cross,
    Fragment,
    Generate,
    Monad,
    Node,
    Plus,
    Print,
    System,
    User,
)

__all__ = ["block_text", "to_chat_messages"]

BLOCK_SEPARATOR = "\n\n"


def block_text(node: Node, path: str = "$") -> str:
    """The text a node contributes when it is read as one block of content."""
    if isinstance(node, (System, User, Assistant, Fragment)):
        return node.text
    if isinstance(node, (Plus, Cross)):
        parts = [block_text(c, f"{path}.{node.keyword}[{i}]") for i, c in enumerate(node.children)]
        return BLOCK_SEPARATOR.join(p for p in parts if p)
    if isinstance(node, (Monad, Print)):
        return ""
    if isinstance(node, (Generate, Combine)):
        raise QueryValidationError(
            path, f"a {type(node).__name__} must be executed before its output can be read"
        )
    raise QueryValidationError(
        path, f"{type(node).__name__} must be lowered by the optimizer before execution"
    )


def to_chat_messages(node: Node, path: str = "$") -> list[dict[str, str]]:
    """Chat messages (`{"role", "content"}`) for the input of a `Generate`."""
    pieces: list[tuple[str, str]] = []

    def go(n: Node, p: str) -> None:
        if isinstance(n, System):
            pieces.append(("system", n.text))
        elif isinstance(n, User):
            pieces.append(("user", n.text))
        elif isinstance(n, Assistant):
            pieces.append(("assistant", n.text))
        elif isinstance(n, Cross):
            for i, c in enumerate(n.children):
                go(c, f"{p}.{n.keyword}[{i}]")
        elif isinstance(n, (Fragment, Plus)):
            pieces.append(("user", block_text(n, p)))
        else:
            block_text(n, p)  # raises for what cannot be read; Monad/Print contribute nothing

    go(node, path)
    messages: list[dict[str, str]] = []
    for role, text in pieces:
        if not text:
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += BLOCK_SEPARATOR + text
        else:
            messages.append({"role": role, "content": text})
    if not messages:
        raise QueryValidationError(path, "the generate's input is empty: nothing to send to the model")
    return messages
