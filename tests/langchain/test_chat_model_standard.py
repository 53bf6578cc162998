"""LangChain's standard test suites for `ChatSpanQuery`: the unit tests; the integration tests on the tiny
embedded backend; and the tool-calling and structured-output tests on SmolLM2 (a random model writes schema-valid
JSON, but not the arguments a test expects). Multimodal input does not apply: the suite skips it."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.exceptions import OutputParserException
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
    def has_tool_calling(self) -> bool:
        return False  # TestChatSpanQueryToolsOnSmolLM2

    @property
    def has_structured_output(self) -> bool:
        return False  # TestChatSpanQueryToolsOnSmolLM2

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


TOOL_TESTS = ("tool", "structured", "json_mode", "agent_loop")
# SmolLM2's longest tool call in these tests is 67 tokens, its JSON answers 19-47; at temperature 0 it fills some
# schemas with a repeated phrase until the limit (refused as cut off: below), at ~20 tokens/s on this machine: 80
# (the longest call and room to spare), not 200 or 96, saves those calls seconds each (the class: 169 -> 137 s).
TOOL_MAX_TOKENS = 80


@pytest.mark.vllm
@pytest.mark.slow
class TestChatSpanQueryToolsOnSmolLM2(ChatModelIntegrationTests):
    """The standard tool-calling and structured-output tests, on the embedded default model (SmolLM2-135M)."""

    backend: Any = None

    @pytest.fixture(autouse=True)
    def _tools_only_on_smollm2(self, request):
        if not any(word in request.node.name for word in TOOL_TESTS):
            pytest.skip("run on the tiny model by TestChatSpanQueryIntegration")
        from spanq_backend.serving.embedded import shared_embedded_backend

        type(self).backend = shared_embedded_backend()

    @property
    def chat_model_class(self) -> type[ChatSpanQuery]:
        return ChatSpanQuery

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"backend": self.backend, "max_tokens": TOOL_MAX_TOKENS, "temperature": 0}

    @property
    def supports_json_mode(self) -> bool:
        return True

    # At temperature 0 SmolLM2 fills the pydantic Joke's "setup" with a phrase repeated until any limit ("A cat is a
    # cat, a cat is a cat, ..."; the same at 80 and 200 tokens), so two of this test's four answers are cut off by
    # max_tokens. They were read as whole (LangChain's JSON parser takes a cut-off object) and the test passed on
    # a guess; a cut-off answer is an OutputParserException now, as the README says (and as ChatOpenAI's parse
    # refuses a "length" finish). Its other two answers end and parse.
    @pytest.mark.xfail(raises=OutputParserException, strict=True,
                       reason="SmolLM2 repeats a phrase in the JSON until max_tokens at temperature 0")  # fmt: skip
    def test_structured_output_optional_param(self, model: Any) -> None:
        super().test_structured_output_optional_param(model)
