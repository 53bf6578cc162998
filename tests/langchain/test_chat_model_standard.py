"""LangChain's standard test suites for `ChatSpanQuery`: the unit tests, and the integration tests on the tiny
embedded backend (tool calling, structured output and multimodal input do not apply: the suite skips them)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from spanq_integrations.langchain import ChatSpanQuery, span_block


class TestChatSpanQueryUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatSpanQuery]:
        return ChatSpanQuery

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "tiny"}  # no backend is started until the first call

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        env = {"SPANQ_BACKEND": "http://127.0.0.1:9/v1", "SPANQ_API_KEY": "env-key"}
        return env, {}, {"backend": "http://127.0.0.1:9/v1", "api_key": "env-key"}


@pytest.mark.vllm
class TestChatSpanQueryIntegration(ChatModelIntegrationTests):
    backend: Any = None

    @pytest.fixture(autouse=True)
    def _on_the_tiny_backend(self, tiny_backend):
        type(self).backend = tiny_backend

    @property
    def chat_model_class(self) -> type[ChatSpanQuery]:
        return ChatSpanQuery

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"backend": self.backend, "max_tokens": 8, "temperature": 0}

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """Two documents as span blocks, asked about twice in opposite orders: the second call reads them from
        the span cache."""
        llm = self.chat_model_class(**self.chat_model_params)
        docs = [
            "The lighthouse of Lindale Harbor was lit for the first time in 1887 and is still kept by hand.",
            "Brackwell's cider press in the market square runs every autumn from September to November.",
        ]
        first = [span_block(d, id=f"doc{i}") for i, d in enumerate(docs)]
        llm.invoke([HumanMessage([*first, "Which one is older?"])])
        message = HumanMessage([*reversed(first), "Which one is older?"])
        if not stream:
            return llm.invoke([message])
        full: AIMessageChunk | None = None
        for chunk in llm.stream([message]):
            full = chunk if full is None else full + chunk
        assert full is not None
        return full
