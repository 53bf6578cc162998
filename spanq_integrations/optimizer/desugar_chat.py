"""Rule 1, chat desugaring: `Chat(messages, settings)` becomes `Generate(Cross(messages), settings)`."""

from __future__ import annotations

from spanq_integrations.optimizer.context import OptimizerContext
from spanq_integrations.query.ir import Chat, Cross, Generate, Node, transform

__all__ = ["desugar_chat"]


def desugar_chat(node: Node, ctx: OptimizerContext) -> Node:
    """Lower every `Chat` to the generate call it stands for: its messages, in order, are the input."""
    return transform(node, _lower_chat)


def _lower_chat(node: Node) -> Node:
    if not isinstance(node, Chat):
        return node
    return Generate(
        input=Cross(children=node.messages),
        model=node.model,
        max_tokens=node.max_tokens,
        temperature=node.temperature,
    )
