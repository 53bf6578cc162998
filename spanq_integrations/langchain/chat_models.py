"""`ChatSpanQuery`: a LangChain chat model whose calls are span queries, so retrieved documents are cached as spans."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from spanq_integrations.langchain.client import CallOutcome, SpanQueryClient
from spanq_integrations.langchain.messages import prompt_from_messages

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
    `input_token_details["cache_read"]`, and `response_metadata["spanq"]` reports cached/padded tokens,
    prepared spans, spans and time to first token. Per-call keyword arguments: `model`, `temperature`,
    `max_tokens`, `seed`, `stop`, and `span_documents` (documents to find in the prompt and send as spans).

    Text only: tool calling, structured output and images are not supported (`UnsupportedMessageError`).
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

    # ----------------------------------------------------------------------------------------- results

    @staticmethod
    def _result(outcome: CallOutcome) -> ChatResult:
        message = AIMessage(
            content=outcome.text,
            usage_metadata=outcome.usage_metadata(),  # type: ignore[arg-type]
            response_metadata=outcome.response_metadata(),
        )
        return ChatResult(
            generations=[
                ChatGeneration(message=message, generation_info={"finish_reason": outcome.finish_reason})
            ],
            llm_output={"model_name": outcome.model_name, "token_usage": outcome.token_usage()},
        )

    @staticmethod
    def _last_chunk(outcome: CallOutcome) -> ChatGenerationChunk:
        message = AIMessageChunk(
            content="",
            usage_metadata=outcome.usage_metadata(),  # type: ignore[arg-type]
            response_metadata=outcome.response_metadata(),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": outcome.finish_reason})

    def _begin(
        self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, kwargs: dict[str, Any]
    ):
        return self._prepare(prompt_from_messages(messages), run_manager, kwargs), self._settings(
            stop, kwargs
        )

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
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=item))
            if run_manager is not None:
                await run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk
