"""LangChain adapters of spanq: swap your LLM for `ChatSpanQuery` and retrieved documents become cached spans.

Needs the `[langchain]` extra (`pip install "spanq[langchain]"`). What works unchanged and what needs one line
changed is listed in README.md ("LangChain"). Importing this package adds a callback handler to every
LangChain run of the process (`run_documents`): it lets spanq's models find the documents a run retrieved.
"""

from __future__ import annotations

try:
    import langchain_core  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        "spanq_integrations.langchain needs langchain-core: pip install 'spanq[langchain]'"
    ) from e

from spanq_integrations.langchain.chat_models import ChatSpanQuery
from spanq_integrations.langchain.judge import DEFAULT_JUDGE_TASK, JudgeEnsemble, JudgeVerdict
from spanq_integrations.langchain.llms import SpanQueryLLM
from spanq_integrations.langchain.messages import UnsupportedMessageError
from spanq_integrations.langchain.retrieval_chain import (
    NoDocumentsError,
    create_span_documents_chain,
    create_span_retrieval_chain,
)
from spanq_integrations.langchain.retrievers import SpanRetriever
from spanq_integrations.langchain.run_documents import install_tracker
from spanq_integrations.langchain.spans import (
    SpanDocuments,
    corpus_texts,
    format_docs_as_spans,
    is_tagged_document,
    span_block,
    span_marker,
    tag_document,
)

install_tracker()


def __getattr__(name: str):
    # The agent middleware needs `langchain` (1.x, which brings LangGraph): imported when it is asked for.
    if name == "SpanCacheMiddleware":
        from spanq_integrations.langchain.middleware import SpanCacheMiddleware

        return SpanCacheMiddleware
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_JUDGE_TASK",
    "ChatSpanQuery",
    "JudgeEnsemble",
    "JudgeVerdict",
    "NoDocumentsError",
    "SpanCacheMiddleware",
    "SpanDocuments",
    "SpanQueryLLM",
    "SpanRetriever",
    "UnsupportedMessageError",
    "corpus_texts",
    "create_span_documents_chain",
    "create_span_retrieval_chain",
    "format_docs_as_spans",
    "is_tagged_document",
    "span_block",
    "span_marker",
    "tag_document",
]
