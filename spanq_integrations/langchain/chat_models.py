"""`ChatSpanQuery`: a LangChain chat model whose calls are span queries, so retrieved documents are cached as spans."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel

from spanq_integrations.langchain.client import CallOutcome, SpanQueryClient, combined_llm_output
from spanq_integrations.langchain.messages import prompt_from_messages, with_instruction
from spanq_integrations.runtime.tools import ToolSpec, read_reply, tools_instruction


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"

__all__ = ["ChatSpanQuery"]


class ChatSpanQuery(SpanQueryClient, BaseChatModel):
    """A chat model on spanq: swap it in for your LLM and retrieved documents are reused from the span cache.

    ```python
    from spanq_integrations.langchain import ChatSpanQuery

    llm = ChatSpanQuery()                                    # embedded span-aware engine, default model
    llm = ChatSpanQuery(backend="http://localhost:8000/v1")  # any OpenAI-compatible server
    llm = ChatSpanQuery(backend="spanq+http://localhost:8000", max_tokens=128, temperature=0)
    ```

    Messages map to the span query's messages (`SystemMessage` → system, `HumanMessage` → user, `AIMessage` →
    assistant); span blocks (`format_docs_as_spans`, `span_block`) become fragments of one `plus`. Without span
    blocks, the documents retrieved earlier in the same LangChain run are looked for in the prompt and sent as
    spans when that is safe (`recover_documents`); `response_metadata["spanq"]["fallback"]` says why not when it
    is not. Each call is one `generate`; `usage_metadata` counts cached prompt tokens as
    `input_token_details["cache_read"]` and the tokens it prepared as spans as `["cache_creation"]`, and `response_metadata["spanq"]` reports cached/padded tokens,
    prepared spans, spans and time to first token. Per-call keyword arguments: `model`, `temperature`,
    `max_tokens`, `seed`, `stop`, and `span_documents` (documents to find in the prompt and send as spans).

    Tool calling and structured output work on every backend, through constrained decoding
    (`spanq_integrations.runtime.tools`): `bind_tools(tools, tool_choice=...)` ("auto", "any"/"required", a
    tool's name, "none"; one call per answer unless `parallel_tool_calls=True`) and `with_structured_output(schema,
    method="json_schema"|"function_calling"|"json_mode", include_raw=...)`. Images and audio are not supported
    (`UnsupportedMessageError`).
    """

    @property
    def _llm_type(self) -> str:
        return "spanq-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._spanq_identifying_params

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_model_type="chat", **self._spanq_ls_params(stop, kwargs))  # type: ignore[typeddict-item]
        return params

    # ----------------------------------------------------------------------------------------- tools

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Tools the model may call: LangChain tools, functions, pydantic models, TypedDicts or OpenAI tool dicts.

        `tool_choice`: "auto" (default: a call or a text answer), "any"/"required"/True (a call), a tool's name
        (that tool), "none" (no call). The answer's form is enforced by constrained decoding, so the call names a
        bound tool and its arguments have the declared types."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        names = [ToolSpec.from_openai(t).name for t in formatted]
        if isinstance(tool_choice, dict):
            tool_choice = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        if tool_choice is True or tool_choice == "any":
            tool_choice = "required"
        if tool_choice not in (None, "auto", "required", "none") and tool_choice not in names:
            raise ValueError(f"tool_choice {tool_choice!r} names no bound tool (tools: {', '.join(names)})")
        return super().bind(
            tools=formatted, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, **kwargs
        )

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Answers parsed into `schema` (a pydantic model, a TypedDict, a JSON schema or an OpenAI tool dict).

        `method="json_schema"` (default): the answer is JSON constrained to the schema. `"function_calling"`:
        the schema is bound as the one tool the model must call. `"json_mode"`: a JSON object (of `schema` when
        one is given, else any: say in the prompt what it should hold). `include_raw=True` returns `{"raw", "parsed", "parsing_error"}`."""
        if kwargs:
            raise ValueError(f"unexpected arguments: {', '.join(kwargs)}")
        is_model = is_basemodel_subclass(schema)  # pydantic 2, or pydantic.v1
        parser: Runnable
        if method == "json_mode":
            # Any JSON object; given a schema, JSON of that schema (constrained: small models drop the keys the
            # prompt asks for otherwise).
            constraint: dict[str, Any] = {}
            traced: dict[str, Any] = {}
            if schema is not None:
                tool = convert_to_openai_tool(schema)
                v2 = isinstance(schema, type) and issubclass(schema, BaseModel)
                constraint = schema.model_json_schema() if v2 else tool["function"]["parameters"]  # type: ignore[union-attr]
                traced = {"ls_structured_output_format": {"kwargs": {"method": method}, "schema": tool}}
            llm = self.bind(response_format=constraint, **traced)
            parser = PydanticOutputParser(pydantic_object=schema) if is_model else JsonOutputParser()  # type: ignore[arg-type]
        elif schema is None:
            raise ValueError(f"method={method!r} needs a schema")
        elif method == "function_calling":
            tool = convert_to_openai_tool(schema)
            name = tool["function"]["name"]
            llm = self.bind_tools([tool], tool_choice=name, ls_structured_output_format={
                "kwargs": {"method": method}, "schema": tool})
            parser = (PydanticToolsParser(tools=[schema], first_tool_only=True) if is_model  # type: ignore[list-item]
                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method == "json_schema":
            tool = convert_to_openai_tool(schema)
            v2 = isinstance(schema, type) and issubclass(schema, BaseModel)
            json_schema = schema.model_json_schema() if v2 else tool["function"]["parameters"]  # type: ignore[union-attr]
            llm = self.bind(response_format=json_schema, ls_structured_output_format={
                "kwargs": {"method": method}, "schema": tool})
            parser = PydanticOutputParser(pydantic_object=schema) if is_model else JsonOutputParser()  # type: ignore[arg-type]
        else:
            raise ValueError(f"unknown method {method!r}: use json_schema, function_calling or json_mode")
        parser = RunnableLambda(_whole_answer) | parser  # (LangChain's JSON parser reads a cut-off object as whole)
        if not include_raw:
            return llm | parser
        parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        keep_raw = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parse.with_fallbacks([keep_raw], exception_key="parsing_error")

    # ----------------------------------------------------------------------------------------- results

    @staticmethod
    def _message_fields(outcome: CallOutcome) -> dict[str, Any]:
        """content, tool_calls and invalid_tool_calls of the answer (text, unless tools were bound)."""
        tools = outcome.settings.tools
        if not tools:
            return {"content": outcome.text}
        reply = read_reply(outcome.text, tools)
        if reply.error is not None:
            return {"content": "", "invalid_tool_calls": [
                invalid_tool_call(name=None, args=outcome.text, id=_call_id(), error=reply.error)]}
        calls = [tool_call(name=c.name, args=c.arguments, id=_call_id()) for c in reply.calls]
        return {"content": reply.text, "tool_calls": calls}

    def _combine_llm_outputs(self, llm_outputs: list[dict[str, Any] | None]) -> dict[str, Any]:
        """`generate(...).llm_output`: the prompts' token usage summed (BaseChatModel's own returns {})."""
        return combined_llm_output(llm_outputs)

    @classmethod
    def _result(cls, outcome: CallOutcome) -> ChatResult:
        message = AIMessage(
            **cls._message_fields(outcome),
            usage_metadata=outcome.usage_metadata(),  # type: ignore[arg-type]
            response_metadata=outcome.response_metadata(),
        )
        return ChatResult(
            generations=[
                ChatGeneration(message=message, generation_info={"finish_reason": outcome.finish_reason})
            ],
            llm_output={"model_name": outcome.model_name, "token_usage": outcome.token_usage()},
        )

    @classmethod
    def _last_chunk(cls, outcome: CallOutcome) -> ChatGenerationChunk:
        """The closing chunk: usage, metadata, and (with tools) the whole answer, whose JSON was not streamed."""
        fields: dict[str, Any] = {"content": ""}
        if outcome.settings.tools:
            whole = cls._message_fields(outcome)
            fields["content"] = whole["content"]
            valid, invalid = whole.get("tool_calls", []), whole.get("invalid_tool_calls", [])
            # LangChain reads every chunk's args with its partial-JSON parser, also when a stream's chunks are added
            # up: an unreadable call's raw text ('{"tool_calls": [{"name": "add", "arguments": {"a": 3') would read
            # as a valid call. Its args go as a JSON string instead, which no parser reads as arguments: it stays
            # an invalid call in the sum (its error is on this chunk's own `invalid_tool_calls`).
            fields["tool_call_chunks"] = [
                tool_call_chunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i)
                for i, c in enumerate(valid)
            ] + [
                tool_call_chunk(name=c["name"], args=json.dumps(c["args"] or ""), id=c["id"], index=len(valid) + i)
                for i, c in enumerate(invalid)
            ]
        message = AIMessageChunk(
            **fields,
            usage_metadata=outcome.usage_metadata(),  # type: ignore[arg-type]
            response_metadata=outcome.response_metadata(),
            chunk_position="last",
        )
        if outcome.settings.tools and whole.get("invalid_tool_calls"):
            message.invalid_tool_calls = list(whole["invalid_tool_calls"])  # with their errors and raw args
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": outcome.finish_reason})

    def _begin(
        self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, kwargs: dict[str, Any]
    ):
        settings = self._settings(stop, kwargs)
        prompt = prompt_from_messages(messages)
        if settings.tools:
            prompt = with_instruction(prompt, tools_instruction(settings.tools, settings.tool_choice))
        return self._prepare(prompt, run_manager, kwargs), settings

    # ----------------------------------------------------------------------------------------- calls

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prepared, settings = self._begin(messages, stop, run_manager, kwargs)
        return self._result(self._run(prepared, settings))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prepared, settings = self._begin(messages, stop, run_manager, kwargs)
        return self._result(await self._arun(prepared, settings))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        prepared, settings = self._begin(messages, stop, run_manager, kwargs)
        for item in self._iter_tokens(prepared, settings):
            if isinstance(item, CallOutcome):
                yield self._last_chunk(item)
                return
            if settings.tools:
                continue  # a tool call's JSON comes whole, in the last chunk
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=item))
            if run_manager is not None:
                run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        prepared, settings = self._begin(messages, stop, run_manager, kwargs)
        async for item in self._aiter_tokens(prepared, settings):
            if isinstance(item, CallOutcome):
                yield self._last_chunk(item)
                return
            if settings.tools:
                continue  # a tool call's JSON comes whole, in the last chunk
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=item))
            if run_manager is not None:
                await run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk


def _whole_answer(message: BaseMessage) -> BaseMessage:
    """A structured answer cut off by max_tokens is an `OutputParserException`, never what its first keys parse to
    (LangChain's JSON parser reads `{"x":6666` as `{"x": 6666}`)."""
    if message.response_metadata.get("finish_reason") == "length":
        raise OutputParserException(
            "the answer was cut off by max_tokens before its JSON ended: raise max_tokens",
            llm_output=message.content if isinstance(message.content, str) else str(message.content),
        )
    return message
