"""Flatten a closed `Generate` input into ordinary chat messages, for servers that know nothing of spans.

Layout (what an unmodified OpenAI-compatible server receives):
- `System`, `User`, `Assistant` children of a `Cross` keep their roles, in order.
- A `Fragment` outside any `Plus` is user content.
- A `Plus` becomes user content (system content where it says `role="system"`): its children in the order given,
  each one its own text block, blocks separated by a blank line. A generated `Assistant` inside a `Plus` (a candidate to judge) is content there, not an
  assistant turn. Nothing marks the blocks as order-free: such a server cannot use that fact.
- Adjacent pieces of the same role merge into one message (blocks joined by a blank line), so the conversation
  alternates as chat templates expect.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spanq_integrations.query.errors import QueryValidationError
from spanq_integrations.query.ir import (
    AnchorPolicy,
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
    child_paths,
)

__all__ = ["BLOCK_SEPARATOR", "ChatPart", "SpanPart", "block_text", "chat_parts", "to_chat_messages"]

BLOCK_SEPARATOR = "\n\n"


def block_text(node: Node, path: str = "$") -> str:
    """The text a node contributes when it is read as one block of content."""
    if isinstance(node, (System, User, Assistant, Fragment)):
        return node.text
    if isinstance(node, (Plus, Cross)):
        parts = [block_text(c, child_path) for child_path, c in child_paths(node, path)]
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


@dataclass(eq=False)
class SpanPart:
    """One child of a `plus` in a message: its text read as one block, the child, and its group's anchor policy.
    Compared by identity: two equal documents in one prompt are two parts."""

    text: str
    node: Node
    anchor: AnchorPolicy | None = None


@dataclass
class ChatPart:
    """One chat message as pieces: texts, and the `plus` children (`SpanPart`s) among them, in order."""

    role: str
    parts: list[str | SpanPart] = field(default_factory=list)

    @property
    def content(self) -> str:
        return BLOCK_SEPARATOR.join(p.text if isinstance(p, SpanPart) else p for p in self.parts)


def chat_parts(node: Node, path: str = "$") -> list[ChatPart]:
    """The messages of a `Generate`'s input, as pieces (the one walk both a plain server's messages and a span
    engine's prompt are built from): messages keep their roles in order; a fragment outside any `plus` is user
    content; each child of a `plus` is a `SpanPart` of its group's role (user content unless the group says
    system); effects contribute nothing; pieces of the same role next to each other are one message (chat
    templates expect roles to alternate)."""
    messages: list[ChatPart] = []

    def add(role: str, piece: str | SpanPart) -> None:
        if not (piece.text if isinstance(piece, SpanPart) else piece):
            return
        if messages and messages[-1].role == role:
            messages[-1].parts.append(piece)
        else:
            messages.append(ChatPart(role, [piece]))

    def go(n: Node, p: str) -> None:
        if isinstance(n, (System, User, Assistant)):
            add(n.kind, n.text)
        elif isinstance(n, Fragment):
            add("user", n.text)
        elif isinstance(n, Cross):
            for child_path, child in child_paths(n, p):
                go(child, child_path)
        elif isinstance(n, Plus):
            for child_path, child in child_paths(n, p):
                add(n.role or "user", SpanPart(block_text(child, child_path), child, n.anchor))
        else:
            block_text(n, p)  # raises for what cannot be read; Monad/Print contribute nothing

    go(node, path)
    if not messages:
        raise QueryValidationError(path, "the generate's input is empty: nothing to send to the model")
    return messages


def to_chat_messages(node: Node, path: str = "$") -> list[dict[str, str]]:
    """Chat messages (`{"role", "content"}`) for the input of a `Generate`."""
    return [{"role": m.role, "content": m.content} for m in chat_parts(node, path)]
