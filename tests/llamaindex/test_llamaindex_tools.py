"""`SpanQueryLLM` as a LlamaIndex function-calling LLM: `chat_with_tools`, `predict_and_call`,
`structured_predict` and a `FunctionAgent`, through constrained decoding (`runtime.tools`).

The tiny random model (with compact JSON) checks the form: a call names a bound tool with arguments of the
declared types. SmolLM2 checks that the content is right where a small model can get it right."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from spanq_integrations.llamaindex import SpanQueryLLM, messages_to_nodes

pytestmark = [pytest.mark.vllm]


def add(a: int = Field(ge=0, le=99), b: int = Field(ge=0, le=99)) -> int:
    """Adds a and b."""
    return a + b


ADD = FunctionTool.from_defaults(fn=add)


class Town(BaseModel):
    color: Literal["red", "green", "blue"]
    halls: int = Field(ge=0, le=9)



def test_the_llm_says_it_calls_functions():
    assert SpanQueryLLM(backend="http://127.0.0.1:9").metadata.is_function_calling_model


def test_a_tool_call_and_its_result_in_the_history_are_sent_as_text():
    history = [
        ChatMessage(role="user", content="3 plus 4?"),
        ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]}),
        ChatMessage(role=MessageRole.TOOL, content="7", additional_kwargs={"tool_call_id": "c1"}),
    ]
    nodes = messages_to_nodes(history)
    assert json.loads(nodes[1].text) == {"tool_calls": [{"name": "add", "arguments": {"a": 3, "b": 4}}]}
    assert nodes[2].text == "Result of add, call c1:\n7"


def test_a_required_call_names_the_tool_with_typed_arguments(compact_tiny):
    llm = SpanQueryLLM(backend=compact_tiny, max_tokens=40, temperature=0.0)
    response = llm.chat_with_tools([ADD], user_msg="3 plus 4?", tool_required=True)
    (call,) = llm.get_tool_calls_from_response(response)
    assert call.tool_name == "add" and set(call.tool_kwargs) == {"a", "b"}
    assert all(isinstance(v, int) and 0 <= v <= 99 for v in call.tool_kwargs.values())
    out = llm.predict_and_call([ADD], user_msg="3 plus 4?", tool_required=True)
    assert int(out.response) == sum(out.sources[0].raw_input["kwargs"].values())


def test_structured_predict_and_a_cut_off_answer(compact_tiny):
    llm = SpanQueryLLM(backend=compact_tiny, max_tokens=80, temperature=0.0)
    town = llm.structured_predict(Town, PromptTemplate("Lindale's hall is green. Describe the town."))
    assert isinstance(town, Town)
    short = SpanQueryLLM(backend=compact_tiny, max_tokens=3, temperature=0.0)
    response = short.chat_with_tools([ADD], user_msg="3 plus 4?", tool_required=True)
    with pytest.raises(ValueError, match="raise max_tokens"):
        short.get_tool_calls_from_response(response)
    assert short.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []


@pytest.mark.slow
def test_smollm2_calls_the_tool_with_the_right_arguments_and_an_agent_runs():
    from llama_index.core.agent.workflow import FunctionAgent

    from spanq_backend.serving.embedded import shared_embedded_backend

    llm = SpanQueryLLM(backend=shared_embedded_backend(), max_tokens=80, temperature=0.0)
    response = llm.chat_with_tools([ADD], user_msg="What is 3 plus 4? Use the tool.", tool_required=True)
    (call,) = llm.get_tool_calls_from_response(response)
    assert (call.tool_name, call.tool_kwargs) == ("add", {"a": 3, "b": 4})
    assert str(llm.predict_and_call([ADD], user_msg="What is 3 plus 4?", tool_required=True)) == "7"
    # a text answer with tools bound, streamed: one response whose delta is its text (an agent prints deltas)
    rule = ChatMessage(role="system", content="Use the add tool only to add two numbers; else answer in words.")
    texts = []
    for question in ("What is the capital of France?", "Say hello to Ann.", "Name a colour."):
        (text,) = list(llm.stream_chat_with_tools([ADD], user_msg=question, chat_history=[rule], tool_required=False))
        assert (text.delta or "") == text.message.content
        texts += [text.message.content] if text.message.content else []
    assert texts, "SmolLM2 answered every question with a call"
    agent = FunctionAgent(tools=[ADD], llm=llm, system_prompt="Use the add tool for sums.")

    async def ask():
        return await agent.run("What is 3 plus 4?")

    assert str(asyncio.run(ask())).strip()


def test_a_streamed_answer_with_tools_bound_is_one_response_sync_or_async(compact_tiny):
    """With tools bound the answer comes whole, in one response: streamed, sync or async, that response is
    yielded (the sync stream handed LlamaIndex's callback a list iterator, which it refused), its delta its text
    (a text answer's: `test_smollm2_...`)."""
    llm = SpanQueryLLM(backend=compact_tiny, max_tokens=40, temperature=0.0)
    (response,) = list(llm.stream_chat_with_tools([ADD], user_msg="3 plus 4?", tool_required=False))
    assert llm.get_tool_calls_from_response(response) and (response.delta or "") == response.message.content

    async def in_async():
        stream = await llm.astream_chat_with_tools([ADD], user_msg="3 plus 4?", tool_required=False)
        return [r async for r in stream]

    (again,) = asyncio.run(in_async())
    assert again.message.additional_kwargs["tool_calls"][0]["function"] == \
        response.message.additional_kwargs["tool_calls"][0]["function"]
