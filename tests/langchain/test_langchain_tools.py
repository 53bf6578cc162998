"""Tool calling and structured output in `ChatSpanQuery`, on the embedded engine, on a stock vLLM server, and
the errors: a tool choice naming no tool, a schema the engine cannot compile, an answer cut off by max_tokens.

On the tiny random model the answers are nonsense, but their form is not: constrained decoding makes every call
name a bound tool with arguments of the declared types, which is what these tests check. (The standard tests in
`test_chat_model_standard.py` check the content on SmolLM2.)"""

from __future__ import annotations

import json

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from spanq_integrations.langchain import ChatSpanQuery, span_block
from spanq_integrations.query.errors import QueryValidationError, RequestRejectedError
from spanq_integrations.runtime.tools import ToolSpec, read_reply, reply_schema


# Bounded integers: a random model writes digits forever otherwise (the grammar bounds them by the schema).
class AddArgs(BaseModel):
    a: int = Field(ge=0, le=99)
    b: int = Field(ge=0, le=99)


@tool(args_schema=AddArgs)
def add(a: int, b: int) -> int:
    """Adds a and b."""
    return a + b


class DoubleArgs(BaseModel):
    x: int = Field(ge=0, le=99)


@tool(args_schema=DoubleArgs)
def double(x: int) -> int:
    """Doubles x."""
    return 2 * x


class Count(BaseModel):
    apples: int = Field(ge=0, le=99)
    pears: int = Field(ge=0, le=99)


SPECS = [ToolSpec("add", "Adds", {"type": "object", "properties": {"a": {"type": "integer"}}}), ToolSpec("double")]


# --------------------------------------------------------------------------------------------- the schema


def test_the_reply_schema_follows_the_tool_choice():
    auto = reply_schema(SPECS, "auto")
    assert len(auto["anyOf"]) == 2 and auto["anyOf"][1]["required"] == ["answer"]
    required = reply_schema(SPECS, "required")
    calls = required["properties"]["tool_calls"]
    assert calls["minItems"] == 1 and calls["maxItems"] == 1
    assert [c["properties"]["name"]["const"] for c in calls["items"]["anyOf"]] == ["add", "double"]
    named = reply_schema(SPECS, "double", parallel=True)["properties"]["tool_calls"]
    assert named["items"]["properties"]["name"] == {"const": "double"} and "maxItems" not in named


def test_replies_are_read_or_say_what_is_wrong():
    assert read_reply('{"answer": "hi"}', SPECS).text == "hi"
    reply = read_reply('{"tool_calls": [{"name": "add", "arguments": {"a": 1}}]}', SPECS)
    assert reply.calls[0].name == "add" and reply.calls[0].arguments == {"a": 1}
    assert "not complete JSON" in read_reply('{"tool_calls": [{"na', SPECS).error
    assert "not a call of a bound tool" in read_reply('{"tool_calls": [{"name": "rm", "arguments": {}}]}', SPECS).error


def test_bind_tools_refuses_what_it_cannot_send():
    llm = ChatSpanQuery(backend="http://127.0.0.1:9")
    with pytest.raises(ValueError, match="names no bound tool"):
        llm.bind_tools([add], tool_choice="multiply")
    with pytest.raises(QueryValidationError, match="parameters must be a JSON schema of an object"):
        llm.bind_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])
    with pytest.raises(QueryValidationError, match="needs a name"):
        llm.bind_tools([{"type": "function", "function": {"description": "nameless"}}])


# --------------------------------------------------------------------------------------------- on an engine



def calls_of(message: AIMessage) -> list[tuple[str, set[str]]]:
    return [(c["name"], set(c["args"])) for c in message.tool_calls]


@pytest.mark.vllm
def test_a_forced_call_names_the_tool_with_typed_arguments_invoked_and_streamed(compact_tiny):
    llm = ChatSpanQuery(backend=compact_tiny, max_tokens=60, temperature=0).bind_tools([add, double], tool_choice="add")
    message = llm.invoke("What is 3 plus 4?")
    assert calls_of(message) == [("add", {"a", "b"})]
    assert all(isinstance(v, int) for v in message.tool_calls[0]["args"].values())
    streamed = None
    for chunk in llm.stream("What is 3 plus 4?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert calls_of(streamed) == [("add", {"a", "b"})]


@pytest.mark.vllm
def test_tool_calls_keep_spans_and_read_an_agent_transcript(compact_tiny):
    """Documents as span blocks beside bound tools: the call is still a call, and the spans are used."""
    docs = [span_block("Apples cost 3 coins.", id="a"), span_block("Pears cost 4 coins.", id="p")]
    llm = ChatSpanQuery(backend=compact_tiny, max_tokens=60, temperature=0).bind_tools([add], tool_choice="required")
    first = llm.invoke([HumanMessage([*docs, "What do an apple and a pear cost?"])])
    assert calls_of(first) == [("add", {"a", "b"})]
    assert first.response_metadata["spanq"]["spans"] == 2
    call = first.tool_calls[0]
    again = llm.invoke([HumanMessage([*reversed(docs), "What do an apple and a pear cost?"]), first,
                        ToolMessage("7", tool_call_id=call["id"])])
    assert calls_of(again) == [("add", {"a", "b"})]
    assert again.response_metadata["spanq"]["prepared_spans"] == 0, "the documents came from the span cache"


@pytest.mark.vllm
def test_structured_output_parses_into_the_schema_every_method(compact_tiny):
    llm = ChatSpanQuery(backend=compact_tiny, max_tokens=40, temperature=0)
    for method in ("json_schema", "function_calling", "json_mode"):
        result = llm.with_structured_output(Count, method=method).invoke("How many apples and pears?")
        assert isinstance(result, Count), method
    raw = llm.with_structured_output(Count.model_json_schema(), include_raw=True).invoke("Count them.")
    assert set(raw["parsed"]) == {"apples", "pears"} and raw["parsing_error"] is None
    assert json.loads(raw["raw"].content) == raw["parsed"]


@pytest.mark.vllm
def test_openai_style_response_formats_constrain_the_answer_as_chatopenai_reads_them(compact_tiny):
    """Code ported from ChatOpenAI passes OpenAI's forms: each constrains the answer as it says (they were
    sent on as if each were the schema itself: `{"type": "json_object"}` a schema no answer can meet)."""
    llm = ChatSpanQuery(backend=compact_tiny, max_tokens=40, temperature=0)
    wrapped = {"type": "json_schema", "json_schema": {"name": "count", "schema": Count.model_json_schema()}}
    for form in (wrapped, Count):
        assert set(json.loads(llm.invoke("Count them.", response_format=form).content)) == {"apples", "pears"}
    # any JSON object (the random model writes one key on until max_tokens: the start says it is an object)
    assert llm.invoke("Count them.", response_format={"type": "json_object"}).content.startswith('{"')
    plain = llm.invoke("Count them.", response_format={"type": "text"}).content
    assert plain == llm.invoke("Count them.").content
    with pytest.raises(ValueError, match="json_schema"):
        llm.invoke("Count them.", response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(TypeError, match="response_format"):
        llm.invoke("Count them.", response_format="json")


@pytest.mark.vllm
def test_an_answer_cut_off_by_max_tokens_is_reported_not_guessed(compact_tiny):
    """LangChain's documented behaviour: an unreadable call is an invalid tool call; an unparsable structured
    answer is an OutputParserException (or `parsing_error` with include_raw)."""
    short = ChatSpanQuery(backend=compact_tiny, max_tokens=3, temperature=0)
    message = short.bind_tools([add], tool_choice="add").invoke("3 plus 4?")
    assert message.tool_calls == []
    assert "raise max_tokens" in message.invalid_tool_calls[0]["error"]
    # streamed, the chunks added up (what an agent's stream, LangGraph's "messages" mode, a UI reads): still no
    # call to dispatch (LangChain's partial-JSON parser read the cut-off text as a call named '')
    chunks = list(short.bind_tools([add], tool_choice="add").stream("3 plus 4?"))
    summed = sum(chunks[1:], chunks[0])
    assert summed.tool_calls == [] and len(summed.invalid_tool_calls) == 1, summed
    assert "raise max_tokens" in chunks[-1].invalid_tool_calls[0]["error"]  # the last chunk says why
    with pytest.raises(OutputParserException):
        short.with_structured_output(Count).invoke("Count them.")
    raw = short.with_structured_output(Count, include_raw=True).invoke("Count them.")
    assert raw["parsed"] is None and isinstance(raw["parsing_error"], OutputParserException)
    # A JSON schema (a dict) or JSON mode: LangChain's JSON parser reads a cut-off object ('{"x":6666') as whole,
    # which came back as {'x': 6666} with its required keys missing, or {}.
    schema = {"title": "P", "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}},
              "required": ["x", "y"]}  # fmt: skip
    cut = ChatSpanQuery(backend=compact_tiny, max_tokens=8, temperature=0)
    for runnable in (cut.with_structured_output(schema), cut.with_structured_output(method="json_mode")):
        with pytest.raises(OutputParserException, match="cut off by max_tokens.*raise max_tokens"):
            runnable.invoke("x=3, y=hi")
    raw = cut.with_structured_output(schema, include_raw=True).invoke("x=3, y=hi")
    assert raw["raw"].response_metadata["finish_reason"] == "length"
    assert raw["parsed"] is None and "cut off by max_tokens" in str(raw["parsing_error"])


@pytest.mark.vllm
def test_a_schema_the_engine_cannot_compile_is_a_clear_error(compact_tiny):
    llm = ChatSpanQuery(backend=compact_tiny, max_tokens=10)
    broken = {"title": "Broken", "type": "object", "properties": {"x": {"$ref": "#/$defs/nowhere"}}, "required": ["x"]}
    with pytest.raises(RequestRejectedError):
        llm.with_structured_output(broken).invoke("hi")
    assert llm.invoke("hi").content is not None, "the engine still serves"


@pytest.mark.vllm
def test_a_stock_vllm_server_gets_the_same_calls_through_response_format(stock_vllm_server):
    llm = ChatSpanQuery(backend=f"{stock_vllm_server}/v1", model="tiny", max_tokens=60, temperature=0)
    message = llm.bind_tools([add, double], tool_choice="double").invoke("Double 21.")
    assert calls_of(message) == [("double", {"x"})]
    assert isinstance(llm.with_structured_output(Count).invoke("How many?"), Count)
