"""`SpanQueryLLM`: a LangChain completion-style LLM (text in, text out) on spanq.

The prompt string is sent as one user turn through the model's chat template; the documents the surrounding
run retrieved (or `span_documents=`) are found in it and sent as spans, as `ChatSpanQuery` does.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.language_models.base import LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from spanq_integrations.langchain.client import CallOutcome, SpanQueryClient, combined_llm_output
from spanq_integrations.langchain.messages import prompt_from_text

__all__ = ["SpanQueryLLM"]

_BATCH_RUNS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("spanq_batch_runs", default=None)


def _generation_info(outcome: CallOutcome) -> dict[str, Any]:
    return {
        "finish_reason": outcome.finish_reason,
        "model_name": outcome.model_name,
        "usage_metadata": outcome.usage_metadata(),
        "spanq": outcome.span_stats(),
    }


def _llm_output(outcomes: list[CallOutcome]) -> dict[str, Any]:
    return combined_llm_output([{"token_usage": o.token_usage(), "model_name": o.model_name} for o in outcomes])


class SpanQueryLLM(SpanQueryClient, BaseLLM):
    """A text-in, text-out LLM on spanq, with the same parameters and backends as `ChatSpanQuery`.

    Each generation's `generation_info` holds `finish_reason`, `usage_metadata` (with cached tokens) and the
    span-cache statistics (`"spanq"`); `llm_output["token_usage"]` sums them over the prompts of a call.
    """

    @property
    def _llm_type(self) -> str:
        return "spanq"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._spanq_identifying_params

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return LangSmithParams(ls_model_type="llm", **self._spanq_ls_params(stop, kwargs))  # type: ignore[typeddict-item]

    def _begin(self, prompt: str, stop: list[str] | None, run_manager: Any, kwargs: dict[str, Any]):
        return self._prepare(prompt_from_text(prompt), run_manager, kwargs), self._settings(stop, kwargs)

    # LangChain hands `_generate` the run of a batch's first prompt only (`BaseLLM._generate_helper`: "TODO: support
    # multiple run managers"), and each prompt's documents are found by its own run: every prompt of `batch` after
    # the first was matched against the first one's documents. The helper is given every prompt's run; it is kept
    # here for `_generate` (where LangChain has no such helper, each prompt falls back to the run it is given).
    def _generate_helper(self, prompts: list[str], stop: Any, run_managers: list[Any], **kwargs: Any) -> LLMResult:
        held = _BATCH_RUNS.set(list(run_managers))
        try:
            return super()._generate_helper(prompts, stop, run_managers, **kwargs)  # type: ignore[misc]
        finally:
            _BATCH_RUNS.reset(held)

    async def _agenerate_helper(self, prompts: list[str], stop: Any, run_managers: list[Any], **kwargs: Any) -> LLMResult:
        held = _BATCH_RUNS.set(list(run_managers))
        try:
            return await super()._agenerate_helper(prompts, stop, run_managers, **kwargs)  # type: ignore[misc]
        finally:
            _BATCH_RUNS.reset(held)

    @staticmethod
    def _runs(prompts: list[str], run_manager: Any) -> list[Any]:
        """Each prompt's run: the batch's, where LangChain gave them to the helper for these prompts."""
        runs = _BATCH_RUNS.get()
        if runs is not None and len(runs) == len(prompts) and (run_manager is None or runs[0] is run_manager):
            return runs
        return [run_manager] * len(prompts)

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        runs = self._runs(prompts, run_manager)
        if self.streaming:
            outcomes = [self._collect_stream(p, stop, run, kwargs) for p, run in zip(prompts, runs)]
        else:
            calls = [self._begin(p, stop, run, kwargs) for p, run in zip(prompts, runs)]
            outcomes = self._run_many(calls)
        return LLMResult(
            generations=[[Generation(text=o.text, generation_info=_generation_info(o))] for o in outcomes],
            llm_output=_llm_output(outcomes),
        )

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        runs = self._runs(prompts, run_manager)
        if self.streaming:  # as the sync path: each piece to `on_llm_new_token`, prompts one after another
            outcomes = [await self._acollect_stream(p, stop, run, kwargs) for p, run in zip(prompts, runs)]
        else:
            calls = [self._begin(p, stop, run, kwargs) for p, run in zip(prompts, runs)]
            outcomes = list(await asyncio.gather(*(self._arun(*c) for c in calls)))
        return LLMResult(
            generations=[[Generation(text=o.text, generation_info=_generation_info(o))] for o in outcomes],
            llm_output=_llm_output(outcomes),
        )

    def _run_many(self, calls: list[Any]) -> list[CallOutcome]:
        from spanq_integrations.runtime.background_loop import background_loop

        async def all_calls() -> list[CallOutcome]:
            return list(await asyncio.gather(*(self._acall(*c) for c in calls)))

        return background_loop().run(all_calls())

    def _collect_stream(
        self, prompt: str, stop: Any, run_manager: Any, kwargs: dict[str, Any]
    ) -> CallOutcome:
        """`streaming=True`: run one prompt streaming, handing each piece to `on_llm_new_token`."""
        prepared, settings = self._begin(prompt, stop, run_manager, kwargs)
        for item in self._iter_tokens(prepared, settings):
            if isinstance(item, CallOutcome):
                return item
            if run_manager is not None:
                run_manager.on_llm_new_token(item, chunk=GenerationChunk(text=item))
        raise RuntimeError("the stream ended without a result")  # _iter_tokens always ends with one

    async def _acollect_stream(
        self, prompt: str, stop: Any, run_manager: Any, kwargs: dict[str, Any]
    ) -> CallOutcome:
        """`_collect_stream` on the caller's event loop (`ainvoke`, `agenerate` with `streaming=True`)."""
        prepared, settings = self._begin(prompt, stop, run_manager, kwargs)
        async for item in self._aiter_tokens(prepared, settings):
            if isinstance(item, CallOutcome):
                return item
            if run_manager is not None:
                await run_manager.on_llm_new_token(item, chunk=GenerationChunk(text=item))
        raise RuntimeError("the stream ended without a result")  # _aiter_tokens always ends with one

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        prepared, settings = self._begin(prompt, stop, run_manager, kwargs)
        for item in self._iter_tokens(prepared, settings):
            if isinstance(item, CallOutcome):
                yield GenerationChunk(text="", generation_info=_generation_info(item))
                return
            chunk = GenerationChunk(text=item)
            if run_manager is not None:
                run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        prepared, settings = self._begin(prompt, stop, run_manager, kwargs)
        async for item in self._aiter_tokens(prepared, settings):
            if isinstance(item, CallOutcome):
                yield GenerationChunk(text="", generation_info=_generation_info(item))
                return
            chunk = GenerationChunk(text=item)
            if run_manager is not None:
                await run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk
