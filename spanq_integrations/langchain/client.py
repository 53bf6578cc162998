"""What `ChatSpanQuery` and `SpanQueryLLM` share: LangChain's standard parameters, the backend, and one call.

One LangChain call is one span query, `generate(cross(...))`, run by the executor (`aexecute`) on the backend,
on the adapters' background loop (`event_loop`). The prompt's spans come from span blocks, from documents
passed as `span_documents=`, or from the documents the surrounding run retrieved (`run_documents`), in that
order of preference.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.documents import Document
from langchain_core.utils import secret_from_env
from pydantic import BaseModel, Field, PrivateAttr, SecretStr, field_validator, model_validator

from spanq_integrations.backends.protocol import Backend, CallMetrics
from spanq_integrations.backends.resolve import API_KEY_ENV, DEFAULT_MAX_RETRIES, env_backend
from spanq_integrations.langchain.messages import (
    PromptMessage,
    SpanCandidate,
    query_input,
    span_count,
    split_at_documents,
)
from spanq_integrations.langchain.run_documents import install_tracker, run_document_tracker
from spanq_integrations.langchain.spans import document_span_id, span_marker
from spanq_integrations.query.errors import (
    ArgumentTypeError,
    BackendTimeoutError,
    ContextLengthError,
)
from spanq_integrations.query.ir import DEFAULT_TEMPERATURE, MAX_TEMPERATURE, generate
from spanq_integrations.runtime.background_loop import background_loop
from spanq_integrations.runtime.executor import aexecute
from spanq_integrations.runtime.parameters import checked_call_options
from spanq_integrations.runtime.tools import ToolSpec, check_choice, reply_schema

__all__ = ["CallOutcome", "CallSettings", "PreparedPrompt", "SpanQueryClient", "combined_llm_output"]


@dataclass
class PreparedPrompt:
    """A prompt with its spans, and where the spans came from (or why documents could not become spans)."""

    messages: list[PromptMessage]
    span_source: Literal["content_blocks", "span_documents", "run_documents"] | None = None
    fallback: str | None = None
    original: list[PromptMessage] | None = None  # the prompt before documents were cut out of it

    def for_backend(self, span_aware: bool) -> PreparedPrompt:
        """What to send to a backend: an ordinary server gets found documents back in place, as they were."""
        if span_aware or self.span_source is None:
            return self
        if self.original is not None:
            return PreparedPrompt(
                self.original, None, "the backend is not span-aware: the prompt was sent as it is"
            )
        return PreparedPrompt(
            self.messages, None, "the backend is not span-aware: the spans were flattened into their messages"
        )


@dataclass(frozen=True)
class CallSettings:
    model: str
    temperature: float
    max_tokens: int
    stop: tuple[str, ...]
    seed: int | None
    json_schema: str = ""  # the answer is JSON matching this schema ("{}": any JSON object)
    tools: tuple[ToolSpec, ...] = ()  # bound tools: the answer is a tool call or text (`runtime.tools`)
    tool_choice: str = "auto"


@dataclass
class CallOutcome:
    """One finished call: the answer, the executor's metrics for it, and how the prompt was sent."""

    text: str
    metrics: CallMetrics
    settings: CallSettings
    prepared: PreparedPrompt
    span_aware: bool
    spans_sent: int
    backend: str

    @property
    def model_name(self) -> str:
        return self.metrics.model or self.settings.model or self.backend

    @property
    def finish_reason(self) -> str | None:
        """Why the answer ended, as the engine said: "stop", "length" (max_tokens), ...; None if not reported."""
        return self.metrics.finish_reason

    def usage_metadata(self) -> dict[str, Any]:
        m = self.metrics
        return {
            "input_tokens": m.prompt_tokens,
            "output_tokens": m.generated_tokens,
            "total_tokens": m.prompt_tokens + m.generated_tokens,
            # LangChain's names: tokens read from the KV cache, and tokens this call wrote to it as spans
            # (its prepare requests: what a later call reads back as cache_read)
            "input_token_details": {"cache_read": m.cached_tokens, "cache_creation": m.prepared_tokens},
        }

    def token_usage(self) -> dict[str, int]:
        m = self.metrics
        return {
            "prompt_tokens": m.prompt_tokens,
            "completion_tokens": m.generated_tokens,
            "total_tokens": m.prompt_tokens + m.generated_tokens,
            "cached_tokens": m.cached_tokens,
        }

    def span_stats(self) -> dict[str, Any]:
        """What `response_metadata["spanq"]` holds: the span cache's work on this call."""
        m = self.metrics
        return {
            "cached_tokens": m.cached_tokens,
            "padded_tokens": m.padded_tokens,
            "prepared_spans": m.prepared_spans,
            "prepared_tokens": m.prepared_tokens,
            "deferred_spans": m.deferred_spans,
            "ttft_s": m.ttft_s,
            "wall_s": m.wall_s,
            "spans": int(m.extra.get("spans", self.spans_sent if self.span_aware else 0)),
            "recomputed_tokens": int(m.extra.get("recomputed_tokens", 0)),
            "span_source": self.prepared.span_source,
            "fallback": self.prepared.fallback or m.fallback,
            "span_aware": self.span_aware,
            "backend": self.backend,
        }

    def response_metadata(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "finish_reason": self.finish_reason,
            "spanq": self.span_stats(),
        }


def combined_llm_output(outputs: list[dict[str, Any] | None]) -> dict[str, Any]:
    """LangChain's `llm_output` of a call over several prompts: their token usage summed, the first model's name."""
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cached_tokens": 0}
    name = ""
    for out in outputs:
        for key, count in ((out or {}).get("token_usage") or {}).items():
            usage[key] = usage.get(key, 0) + count
        name = name or (out or {}).get("model_name") or ""
    return {"token_usage": usage, "model_name": name}


def _candidates_from(docs: Any) -> list[SpanCandidate]:
    """What to look for in the prompt for `span_documents=`: Documents, strings, or span blocks (whose exact,
    formatted texts the prompt holds, e.g. a `SpanDocuments`)."""
    if isinstance(docs, (str, Document)):
        docs = [docs]
    out = []
    for d in docs or ():
        if isinstance(d, Document):
            out.append(SpanCandidate(d.page_content, document_span_id(d)))
        elif isinstance(d, str):
            out.append(SpanCandidate(d))
        elif isinstance(d, dict) and span_marker(d) is not None:
            out.append(SpanCandidate(str(d.get("text") or ""), span_marker(d).get("id")))
        else:
            raise TypeError(f"span_documents takes Documents, strings or span blocks, got {type(d).__name__}")
    return out


_SPAN_INDEX = re.compile(r"\bspan (\d+)\b")


class SpanQueryClient(BaseModel):
    """The parameters and machinery of spanq's LangChain models (a mixin; not used on its own)."""

    backend: Any = Field(default_factory=env_backend)
    """Where calls run: None or "embedded" — the embedded span-aware engine on the default model (SmolLM2);
    "spanq+http://host:port" — a `spanq serve` server; any other "http(s)://…" URL — an OpenAI-compatible
    server (spans flattened into ordinary messages); or a `Backend` instance. Default: $SPANQ_BACKEND."""
    model: str | None = None
    """The model name sent with each call; None: whatever the backend serves (its first model)."""
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    """Sampling temperature, 0 to 2; None: spanq's default (0.6)."""
    max_tokens: int | None = Field(default=None, ge=0)
    """The most tokens to generate; None: the backend's default."""
    timeout: float | None = Field(default=None, gt=0)
    """Seconds a whole call may take (also the HTTP timeout of URL backends); None: no limit on the call (URL
    backends keep the resolver's HTTP timeout, 600 s)."""
    stop: list[str] | str | None = None
    """Stop sequences (one string: one sequence, as ChatOpenAI reads it)."""
    max_retries: int = Field(default=DEFAULT_MAX_RETRIES, ge=0)
    """URL backends: how often a failed connection is retried."""
    streaming: bool = False
    """Whether `invoke` streams (callbacks' `on_llm_new_token` then sees each piece)."""
    api_key: SecretStr | None = Field(default_factory=secret_from_env(API_KEY_ENV, default=None))
    """URL backends: the bearer token sent. Default: $SPANQ_API_KEY."""
    seed: int | None = None
    """Sampling seed."""
    recover_documents: Literal["auto", "tagged", "off"] = "auto"
    """Whether to look for the documents the surrounding LangChain run retrieved in the prompt and send them as
    spans: "auto" any documents, "tagged" only documents tagged by `SpanRetriever`, "off" never."""
    span_anchor: Literal["template", "system", "prefix"] | None = None
    """What each document's KV is computed after (see `spanq_integrations.plus`): None is the backend's default
    ("template": reused after any question or conversation); "prefix" is exact but reused only after the same
    prompt prefix."""
    recompute: float | Literal["first", "last", "question", "first+question", "attention"] | None = None
    """How much of each document a span backend computes again in context, for quality: 0 none, "first" / "last"
    each document's first / last KV block, "question" as many blocks, those the question shares most with,
    "first+question" each document's first block and as many more, those the question shares most with, "attention"
    as many, those it attends to most (a pass of its own first), a share in (0, 1] of the document blocks; None is
    the backend's default. Other backends ignore it."""

    _backend_instance: Backend | None = PrivateAttr(default=None)
    _owns_backend: bool = PrivateAttr(default=False)
    _backend_lock: Any = PrivateAttr(default_factory=threading.Lock)

    @model_validator(mode="before")
    @classmethod
    def _known_parameters(cls, values: Any) -> Any:
        from spanq_integrations.runtime.parameters import checked_parameters

        return checked_parameters(cls, values)

    @field_validator("recompute")
    @classmethod
    def _check_recompute(cls, value: Any) -> Any:
        from spanq_integrations.query.ir import recompute_in_range

        return recompute_in_range(value)

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, value: Any) -> Any:
        from spanq_integrations.backends.resolve import check_backend_spec
        from spanq_integrations.query.errors import SpanQueryError

        if value is not None and not isinstance(value, (str, Backend)):
            raise TypeError(
                f"backend must be None (the embedded default), a URL, or a spanq Backend, got {type(value).__name__}"
            )
        try:
            return check_backend_spec(value)
        except SpanQueryError as e:
            raise ValueError(str(e)) from None

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        if self.recover_documents != "off":
            install_tracker()

    # ----------------------------------------------------------------------------------------- backend

    @property
    def backend_label(self) -> str:
        if self.backend is None:
            return "embedded"
        return self.backend if isinstance(self.backend, str) else type(self.backend).__name__

    @property
    def backend_key(self) -> str:
        """The backend in LangChain's cache key: a URL (or the embedded default) as given; a `Backend` object by
        what it answers with (`Backend.identity`), not by its class alone (two embedded engines on two models shared
        cached answers)."""
        if self.backend is None or isinstance(self.backend, str):
            return self.backend_label
        return self.backend.identity

    def _make_backend(self) -> tuple[Backend, bool]:
        from spanq_integrations.backends import resolve_backend

        key = self.api_key.get_secret_value() if self.api_key is not None else None
        return resolve_backend(
            self.backend, self.model or None, timeout=self.timeout, max_retries=self.max_retries, api_key=key
        )

    def _get_backend(self) -> Backend:
        """The backend, created on first use (the embedded default starts its engine then)."""
        with self._backend_lock:
            if self._backend_instance is None:
                self._backend_instance, self._owns_backend = self._make_backend()
            return self._backend_instance

    async def _aget_backend(self) -> Backend:
        if self._backend_instance is not None:
            return self._backend_instance
        return await asyncio.to_thread(self._get_backend)

    def get_token_ids(self, text: str) -> list[int]:
        """`text` in the model's own tokens, by the backend (the embedded engine's tokenizer, a server's `/tokenize`):
        what `get_num_tokens`, `get_num_tokens_from_messages` and so `trim_messages(token_counter=llm)` count by.
        LangChain's default counts GPT-2 tokens, which it downloads (offline: 0 for every text, so nothing was ever
        trimmed); it is still the fallback for a server that cannot tokenize."""
        ids = background_loop().run(self._get_backend().token_ids(text, self.model or ""))
        return ids if ids is not None else super().get_token_ids(text)  # type: ignore[misc]

    def close(self) -> None:
        """Close the backend if this model created it from a URL (the embedded default stays up)."""
        with self._backend_lock:
            backend, owned = self._backend_instance, self._owns_backend
            self._backend_instance, self._owns_backend = None, False
        if backend is not None and owned:
            background_loop().run(backend.aclose())

    # ----------------------------------------------------------------------------------------- a call

    def _settings(self, stop: list[str] | str | None, kwargs: dict[str, Any]) -> CallSettings:
        kwargs = checked_call_options(f"{type(self).__name__} call", kwargs, CALL_OPTIONS, RENAMED_CALL_OPTIONS)
        temperature = kwargs.get("temperature", self.temperature)
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        tools = tuple(ToolSpec.from_openai(t) for t in kwargs.get("tools") or ())
        choice = check_choice(tools, kwargs.get("tool_choice")) if tools else "none"
        schema = ""
        if tools and choice != "none":
            schema = json.dumps(reply_schema(tools, choice, parallel=bool(kwargs.get("parallel_tool_calls"))))
        elif kwargs.get("response_format") is not None:
            constraint = _response_schema(kwargs["response_format"])
            schema = "" if constraint is None else json.dumps(constraint)
        return CallSettings(
            model=kwargs.get("model") or self.model or "",
            temperature=DEFAULT_TEMPERATURE if temperature is None else float(temperature),
            max_tokens=int(max_tokens or 0),
            stop=stop_sequences(stop if stop is not None else self.stop, f"{type(self).__name__} call (stop=...)"),
            seed=kwargs.get("seed", self.seed),
            json_schema=schema,
            tools=tools if choice != "none" else (),
            tool_choice=choice,
        )

    def _prepare(
        self, messages: list[PromptMessage], run_manager: Any, kwargs: dict[str, Any]
    ) -> PreparedPrompt:
        """Find the prompt's spans: span blocks, else `span_documents=`, else the run's documents."""
        tracker = run_document_tracker()
        run_id = run_manager.run_id if run_manager is not None else tracker.current_model_run()
        if span_count(messages):
            return PreparedPrompt(messages, "content_blocks")
        if kwargs.get("span_documents") is not None:
            source: Literal["span_documents", "run_documents"] = "span_documents"
            candidates = _candidates_from(kwargs["span_documents"])
        elif self.recover_documents != "off" and run_id is not None:
            source = "run_documents"
            candidates = tracker.candidates(run_id, tagged_only=self.recover_documents == "tagged")
            if not candidates and self.recover_documents == "tagged" and (found := tracker.candidates(run_id)):
                return PreparedPrompt(messages, fallback=(
                    f"recover_documents='tagged': the run retrieved {len(found)} document(s), none tagged as a span; "
                    "wrap the retriever in SpanRetriever, or use recover_documents='auto'"))
        else:
            return PreparedPrompt(messages)
        split, reason = split_at_documents(messages, candidates)
        if split is None:
            return PreparedPrompt(messages, fallback=reason)
        return PreparedPrompt(split, source, original=messages)

    async def _acall(
        self, prepared: PreparedPrompt, settings: CallSettings, on_token: Callable[[str], Any] | None = None
    ) -> CallOutcome:
        """Run one call on the background loop: build the span query for this backend and execute it."""
        backend = await self._aget_backend()
        span_aware = backend.capabilities.span_aware
        prepared = prepared.for_backend(span_aware)
        query = generate(
            query_input(prepared.messages, span_aware=span_aware, anchor=self.span_anchor),
            model=settings.model,
            max_tokens=settings.max_tokens,
            temperature=settings.temperature,
            stop=settings.stop,
            seed=settings.seed,
            json_schema=settings.json_schema or None,
            recompute=self.recompute,
        )
        run = aexecute(query, backend, on_token=on_token)
        try:
            result = await (asyncio.wait_for(run, self.timeout) if self.timeout else run)
        except BackendTimeoutError:  # the backend's own limit (a URL backend's HTTP timeout): said as it is
            raise
        except TimeoutError as e:
            raise BackendTimeoutError(
                f"{self.backend_label} did not answer within timeout={self.timeout} s; raise the timeout"
            ) from e
        except ContextLengthError as e:
            raise self._explain_context_length(e, prepared) from e
        metrics = result.answer_call or (result.calls[-1] if result.calls else CallMetrics())
        return CallOutcome(
            text=result.answer,
            metrics=metrics,
            settings=settings,
            prepared=prepared,
            span_aware=span_aware,
            spans_sent=span_count(prepared.messages),
            backend=backend.capabilities.name,
        )

    @staticmethod
    def _explain_context_length(error: ContextLengthError, prepared: PreparedPrompt) -> ContextLengthError:
        spans = [p for m in prepared.messages for p in m.parts if not isinstance(p, str)]
        if not spans:
            return error  # no documents: the prompt itself is too long (the error says so)
        hint = (
            " — a document is too long for the model's context: split documents into smaller chunks before "
            "indexing them (a text splitter), retrieve fewer, or use a model with a longer context"
        )
        found = _SPAN_INDEX.search(str(error))
        if found and int(found.group(1)) < len(spans):
            span = spans[int(found.group(1))]
            name = f"{span.id!r}" if span.id else "#" + found.group(1)
            hint = f" — document {name} ({len(span.text)} characters){hint[len(' — a document') :]}"
        return ContextLengthError(f"{error}{hint}")

    # ----------------------------------------------------------------------------------------- bridges

    def _run(self, prepared: PreparedPrompt, settings: CallSettings) -> CallOutcome:
        return background_loop().run(self._acall(prepared, settings))

    async def _arun(self, prepared: PreparedPrompt, settings: CallSettings) -> CallOutcome:
        return await background_loop().arun(self._acall(prepared, settings))

    def _iter_tokens(self, prepared: PreparedPrompt, settings: CallSettings) -> Iterator[str | CallOutcome]:
        """Text pieces as they arrive, then the `CallOutcome` (for sync streaming, from any thread)."""
        stream = background_loop().stream(lambda on_token: self._acall(prepared, settings, on_token=on_token))
        yield from stream
        yield stream.result

    async def _aiter_tokens(
        self, prepared: PreparedPrompt, settings: CallSettings
    ) -> AsyncIterator[str | CallOutcome]:
        """Text pieces as they arrive, then the `CallOutcome` (for async streaming on the caller's loop)."""
        stream = background_loop().astream(lambda on_token: self._acall(prepared, settings, on_token=on_token))
        async for piece in stream:
            yield piece
        yield stream.result

    # ----------------------------------------------------------------------------------------- LangChain

    @property
    def _spanq_identifying_params(self) -> dict[str, Any]:
        return {
            "backend": self.backend_key,
            "model": self.model,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "stop": self.stop,
            "seed": self.seed,
            # What changes an answer is part of LangChain's cache key: two models that differ only in how spans
            # are computed (or whether documents are sent as spans at all) must not share cached answers.
            "span_anchor": self.span_anchor,
            "recompute": self.recompute,
            "recover_documents": self.recover_documents,
        }

    def _spanq_ls_params(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        params: dict[str, Any] = {
            "ls_provider": "spanq",
            "ls_model_name": kwargs.get("model") or self.model or "default",
        }
        temperature = kwargs.get("temperature", self.temperature)
        params["ls_temperature"] = DEFAULT_TEMPERATURE if temperature is None else temperature
        max_tokens = kwargs.get("max_tokens", kwargs.get("max_completion_tokens", self.max_tokens))
        if max_tokens:
            params["ls_max_tokens"] = max_tokens
        if stop or self.stop:
            with contextlib.suppress(TypeError):  # (for tracing only: the call itself names a bad `stop`)
                params["ls_stop"] = list(stop_sequences(stop or self.stop, "stop"))
        return params


# The options a call reads (`invoke(..., **options)`, `bind(...)`, `bind_tools`); any other is refused by name.
CALL_OPTIONS = frozenset({
    "temperature", "max_tokens", "seed", "model", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "span_documents",
    "strict",  # a tool's or schema's strictness (ChatOpenAI's): constrained decoding keeps every answer to it anyway
    "ls_structured_output_format",  # LangChain's tracing of `with_structured_output` (a chat model's run pops it)
})
RENAMED_CALL_OPTIONS = {"max_completion_tokens": "max_tokens"}  # ChatOpenAI's newer spelling


def stop_sequences(stop: Any, where: str) -> tuple[str, ...]:
    """Stop sequences as a tuple: one string is one sequence (a string's characters each stopped the answer)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise ArgumentTypeError(where, f"stop sequences are a string or a list of strings, not {stop!r}")


def _response_schema(response_format: Any) -> dict[str, Any] | None:
    """The JSON schema a `response_format` constrains the answer to ({}: any JSON object; None: none), read as
    OpenAI's chat models read it — `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"schema":
    ...}}`, `{"type": "text"}`, a pydantic model — or as a JSON schema itself (`with_structured_output`'s)."""
    if isinstance(response_format, type) and hasattr(response_format, "model_json_schema"):
        return response_format.model_json_schema()
    if not isinstance(response_format, dict):
        raise TypeError(f"response_format must be a dict or a pydantic model, got {type(response_format).__name__}: "
                         '{"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": ...}}, or a '
                         "JSON schema")
    kind = response_format.get("type")
    if kind == "json_object":
        return {}
    if kind == "text":
        return None
    if kind == "json_schema":
        inner = response_format.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
            raise ValueError('response_format {"type": "json_schema"} needs "json_schema": {"schema": {...}}')
        return inner["schema"]
    return response_format  # a JSON schema (its "type", if any, is a JSON type: "object", "array", ...)

