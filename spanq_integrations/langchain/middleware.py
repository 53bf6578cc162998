"""`SpanCacheMiddleware`: documents a LangChain 1.x agent's tools return become order-free spans.

LangChain's agents (`langchain.agents.create_agent`) take middleware; its prompt-caching middlewares (Anthropic's,
for one) are how a LangChain user already asks for caching. This one is spanq's: when a tool returns documents —
a retriever tool made with `create_retriever_tool(..., response_format="content_and_artifact")`, or any tool whose
`ToolMessage.artifact` is a list of `Document`s — the tool message's content becomes one span block per document
(`format_docs_as_spans`), so `ChatSpanQuery` reads each document as a cached span: a later turn, a later
conversation opening differently, or a retrieval of the same documents in another order computes none of them
again. What the other tool results say stays text, as does everything without documents; a model other than
spanq's reads the blocks as ordinary text blocks.

    from langchain.agents import create_agent
    agent = create_agent(ChatSpanQuery(), tools=[retriever_tool], middleware=[SpanCacheMiddleware()])

Needs the `langchain` package (1.x; in the `[langchain]` extra).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any

from langchain.agents.middleware import AgentMiddleware
from langchain_core.documents import Document
from langchain_core.messages import ToolMessage
from langchain_core.prompts import BasePromptTemplate

from spanq_integrations.langchain.spans import DEFAULT_DOCUMENT_SEPARATOR, format_docs_as_spans

__all__ = ["SpanCacheMiddleware"]


class SpanCacheMiddleware(AgentMiddleware):
    """Marks the documents tools return as order-free spans (see the module docstring).

    `tool_names`: the tools whose documents are marked (None: every tool's; `tools` is AgentMiddleware's own
    attribute, the tools a middleware adds). `document_prompt`: how each
    document is written, as `create_retriever_tool` takes it (a template over `page_content` and metadata keys);
    None writes its `page_content`, as the retriever tool does by default.
    """

    def __init__(
        self,
        *,
        tool_names: Collection[str] | None = None,
        document_prompt: BasePromptTemplate | str | None = None,
        separator: str = DEFAULT_DOCUMENT_SEPARATOR,
    ) -> None:
        super().__init__()
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self.document_prompt = document_prompt
        self.separator = separator

    def mark(self, result: Any) -> Any:
        """`result` with its documents as span blocks, where it is a tool message that carries documents."""
        if not isinstance(result, ToolMessage) or result.status == "error":
            return result
        if self.tool_names is not None and result.name not in self.tool_names:
            return result
        docs = result.artifact
        if not isinstance(docs, (list, tuple)) or not docs or not all(isinstance(d, Document) for d in docs):
            return result
        blocks = format_docs_as_spans(docs, self.document_prompt, self.separator)
        if not blocks:
            return result
        return result.model_copy(update={"content": list(blocks)})

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        return self.mark(handler(request))

    async def awrap_tool_call(self, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        return self.mark(await handler(request))
