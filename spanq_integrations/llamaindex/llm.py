"""`SpanQueryLLM`: a LlamaIndex `LLM` that runs on spanq — the embedded span-aware engine (the default), a
`spanq serve` server, or any OpenAI-compatible server.

Each chat or completion call becomes one span-query `Generate` (system / user / assistant messages in a
`cross`) executed by `spanq_integrations.runtime.executor.aexecute`; LlamaIndex's instrumentation events and callbacks
fire as for any LLM. `run_query` and friends execute a whole span query on the same backend: that is how
`SpanQuerySynthesizer` hands retrieved nodes to the model as order-free spans.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import numbers
import threading
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from llama_index.core.base.llms.types import (
    CachePoint,
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
    ThinkingBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, field_validator, model_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from spanq_integrations.backends import Backend, resolve_backend
from spanq_integrations.backends.resolve import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_S, check_backend_spec
from spanq_integrations.llamaindex.run_nodes import current_record, install_tracker
from spanq_integrations.llamaindex.usage import METADATA_KEY, usage_of
from spanq_integrations.optimizer.context import TreeReduction
from spanq_integrations.query.errors import ArgumentValueError, QueryValidationError
from spanq_integrations.query.ir import (
    DEFAULT_TEMPERATURE,
    MAX_TEMPERATURE,
    AnchorPolicy,
    Assistant,
    Generate,
    Node,
    System,
    User,
    assistant,
    cross,
    generate,
    system,
    user,
)
from spanq_integrations.runtime.background_loop import AsyncQueryStream, QueryStream, background_loop
from spanq_integrations.runtime.executor import ExecutionResult, aexecute
from spanq_integrations.runtime.prompt_spans import (
    PromptMessage,
    Role,
    query_input,
    span_count,
    split_at_documents,
)
from spanq_integrations.runtime.tools import (
    ToolCall,
    ToolSpec,
    check_choice,
    read_reply,
    render_calls,
    reply_schema,
    tools_instruction,
)

__all__ = ["DEFAULT_CONTEXT_WINDOW", "SpanQueryLLM", "messages_to_nodes"]

DEFAULT_CONTEXT_WINDOW = 4096
"""The embedded engine's default `max_model_len`; pass `context_window=` for a server with another."""

_SYSTEM_ROLES = (MessageRole.SYSTEM, MessageRole.DEVELOPER)
_ASSISTANT_ROLES = (MessageRole.ASSISTANT, MessageRole.CHATBOT, MessageRole.MODEL)
_CALL_OPTIONS = ("max_tokens", "temperature", "stop", "seed")
_BACKEND_LOCK = threading.Lock()  # guards resolving a backend (rare); module-level so LLMs stay copyable
_LLAMAINDEX_FIX = "answer with SpanQuerySynthesizer, which sends every node as a span"
_ROLE_OF: dict[type, Role] = {System: "system", User: "user", Assistant: "assistant"}
_RECORDED = ("prompt_tokens", "cached_tokens", "generated_tokens", "prepared_spans", "deferred_spans", "ttft_s")
# What the current call's prompt did with the query's nodes (set when its query is built, read when it is done;
# a context variable: concurrent calls in their own tasks each see their own).
_split_note: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("spanq_node_spans", default=None)


def _message_text(message: ChatMessage, where: str) -> str:
    parts: list[str] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif not isinstance(block, (ThinkingBlock, CachePoint)):
            raise QueryValidationError(
                where, f"SpanQueryLLM reads text only, got a {type(block).__name__}: pass text content"
            )
    return "\n".join(parts)


def _calls_of(message: ChatMessage) -> list[dict[str, Any]]:
    """The tool calls an assistant message made (`additional_kwargs["tool_calls"]`, OpenAI's shape)."""
    calls = message.additional_kwargs.get("tool_calls") or []
    out = []
    for c in calls:
        fn = c.get("function", c) if isinstance(c, dict) else {}
        args = fn.get("arguments", {})
        out.append({"id": c.get("id", ""), "name": fn.get("name", ""),
                    "arguments": json.loads(args) if isinstance(args, str) and args else args or {}})
    return out


def messages_to_nodes(messages: Sequence[ChatMessage]) -> list[Node]:
    """LlamaIndex chat messages as span-query messages: system (and developer), user, assistant; an assistant's
    tool calls written as the model writes them (`runtime.tools`), a tool's result as a user turn naming its call."""
    if not messages:
        raise QueryValidationError("messages", "a chat call needs at least one message")
    nodes: list[Node] = []
    names: dict[str, str] = {}
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = MessageRole(message.role)
        text = _message_text(message, where)
        if role in _SYSTEM_ROLES:
            nodes.append(system(text))
        elif role == MessageRole.USER:
            nodes.append(user(text))
        elif role in _ASSISTANT_ROLES:
            calls = _calls_of(message)
            names.update({c["id"]: c["name"] for c in calls})
            if calls:
                text = "\n".join(t for t in (text.strip(), render_calls(
                    [ToolCall(c["name"], c["arguments"]) for c in calls])) if t)
            nodes.append(assistant(text))
        elif role in (MessageRole.TOOL, MessageRole.FUNCTION):
            call_id = str(message.additional_kwargs.get("tool_call_id", ""))
            name = message.additional_kwargs.get("name") or names.get(call_id, "a tool")
            nodes.append(user(f"Result of {name}, call {call_id}:\n{text}"))
        else:
            raise QueryValidationError(
                where, f"role {role.value!r} is not supported: send system, user, assistant and tool messages"
            )
    return nodes


class SpanQueryLLM(FunctionCallingLLM):
    """A LlamaIndex LLM on spanq.

    `backend`: None (or "embedded") runs the shared embedded span-aware engine on the default model, started on
    first use; "spanq+http://host:port" a `spanq serve` server; any other "http(s)://…" URL an OpenAI-compatible
    server (vLLM, llama.cpp, Ollama, OpenAI); or a spanq `Backend` object, which the caller keeps owning.
    `model` names the model for servers that serve several ('' = the backend's default).
    `temperature` defaults to spnl's 0.6, as `generate` and LangChain's models do; spanq's judges
    (`SpanQueryPairwiseEvaluator` here, `judge()`, LangChain's judge) call the model greedily whatever it is set
    to. Pass `temperature=0` for greedy answers.

    Every call's usage (prompt, cached, generated and padded tokens, prepared spans, TTFT) is in the
    response's `additional_kwargs` and `raw`.
    """

    model: str = Field(default="", description="The model to call; '' means the backend's default.")
    temperature: float = Field(
        default=DEFAULT_TEMPERATURE, ge=0.0, le=MAX_TEMPERATURE,
        description="Sampling temperature, 0 to 2 (spnl's 0.6 by default); 0 is greedy.",
    )
    max_tokens: int = Field(default=256, ge=1, description="The most tokens one call generates.")
    context_window: int | None = Field(
        default=None, description="The model's context window; None asks the embedded engine, else 4096."
    )
    timeout: float = Field(default=DEFAULT_TIMEOUT_S, gt=0, description="Seconds an HTTP backend waits for an answer.")
    max_retries: int = Field(default=DEFAULT_MAX_RETRIES, ge=0, description="Retries of an HTTP connection that failed.")
    seed: int | None = Field(default=None, description="Sampling seed, for temperature > 0.")
    recompute: float | Literal["first", "last", "question", "first+question", "attention"] | None = Field(
        default=None,
        description="How much of each node a span backend computes again in context, for quality: 0 none, 'first' "
        "/ 'last' each node's first / last KV block, 'question' as many blocks, those the question shares most with, "
        "'first+question' each node's first block and as many more, those the question shares most with, 'attention' "
        "as many, those it attends to most (a pass of its own first), a share in (0, 1] of the node blocks; None: the "
        "backend's default.",
    )
    span_anchor: AnchorPolicy | None = Field(
        default=None,
        description="What each node recovered from a prompt is computed after, on its own: 'template' (the chat "
        "template's opening: reused after any question), 'system' (plus the system prompt) or 'prefix' (the whole "
        "prompt before the nodes); None: the backend's default. As LangChain's `span_anchor`.",
    )
    backend: str | Backend | None = Field(
        default=None, exclude=True, description="None: embedded; a URL; or a spanq Backend."
    )
    api_key: str | None = Field(default=None, exclude=True, description="Bearer token for HTTP backends.")
    recover_documents: Literal["auto", "off"] = Field(
        default="auto",
        description="'auto': send the nodes the running query (or chat engine) retrieved as spans where the prompt "
        "holds them verbatim (LlamaIndex's own synthesizers); 'off': never. The same setting as LangChain's "
        "`recover_documents` (which also has 'tagged'); response.metadata['spanq'] says what happened.",
    )

    _backend: Backend | None = PrivateAttr(default=None)
    _owns_backend: bool = PrivateAttr(default=False)
    _served_model: str | None = PrivateAttr(default=None)  # the model a server answered with (`metadata`)

    def __init__(self, backend: str | Backend | None = None, **kwargs: Any) -> None:
        check_backend_spec(backend)
        super().__init__(backend=backend, **kwargs)

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

    @classmethod
    def class_name(cls) -> str:
        return "SpanQueryLLM"

    # ----------------------------------------------------------------------------------------- backend

    def get_backend(self) -> Backend:
        """The backend calls run on, resolved (and for the embedded default, started) on first use."""
        if self._backend is not None:
            return self._backend
        with _BACKEND_LOCK:
            if self._backend is None:
                self._backend, self._owns_backend = self._open_backend()
            return self._backend

    async def aget_backend(self) -> Backend:
        """`get_backend` for async callers: a backend not resolved yet (the embedded engine starting, seconds) is
        resolved on a thread, so that the event loop — other calls' streams included — goes on meanwhile."""
        if self._backend is not None:
            return self._backend
        return await asyncio.to_thread(self.get_backend)

    def _open_backend(self) -> tuple[Backend, bool]:
        # The embedded default runs an engine on `model` ('' : the default model); a URL backend sends `model`
        # with calls that name none; `api_key` defaults to $SPANQ_API_KEY (the one resolver reads it).
        return resolve_backend(
            self.backend, self.model or None, timeout=self.timeout, max_retries=self.max_retries, api_key=self.api_key
        )

    def close(self) -> None:
        """Close the HTTP client this LLM opened (the embedded default and passed-in backends stay open)."""
        with _BACKEND_LOCK:
            backend, owned = self._backend, self._owns_backend
            self._backend, self._owns_backend = None, False
        if backend is not None and owned:
            background_loop().run(backend.aclose())

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._context_window(),
            num_output=self.max_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self._model_name(),
            system_role=MessageRole.SYSTEM,
        )

    def _known_backend(self) -> Any:
        return self._backend if self._backend is not None else self.backend

    def _context_window(self) -> int:
        if self.context_window is not None:
            return self.context_window
        engine = getattr(self._known_backend(), "engine", None)  # an embedded backend that is running
        length = getattr(engine, "max_model_len", None)
        return int(length) if length else DEFAULT_CONTEXT_WINDOW

    def _model_name(self) -> str:
        if self.model:
            return self.model
        known = self._known_backend()
        name = getattr(known, "model_name", None) or getattr(known, "model", None)
        if isinstance(name, str) and name:
            return name
        if self._served_model:  # a server's, once it answered
            return self._served_model
        return "spanq-embedded-default" if known in (None, "embedded") else "spanq-server-default"

    # ----------------------------------------------------------------------------------------- span queries

    def generate_call(self, input: Node, **options: Any) -> Generate:
        """A `Generate` over `input` with this LLM's settings; `options` override max_tokens, temperature,
        stop and seed for this call (other keyword arguments LlamaIndex passes along are ignored)."""
        picked = {k: options[k] for k in _CALL_OPTIONS if options.get(k) is not None}
        # (a Generate's 0 is "the server's default", up to the whole context window: not what 0 asks for here)
        max_tokens = picked.get("max_tokens", self.max_tokens)
        whole = isinstance(max_tokens, numbers.Integral) or (isinstance(max_tokens, float) and max_tokens.is_integer())
        if isinstance(max_tokens, bool) or not whole or max_tokens < 1:
            raise ArgumentValueError(
                "max_tokens (this call's)", f"max_tokens must be a whole number of at least 1, got {max_tokens!r}"
            )
        return generate(
            input,
            model=self.model,
            max_tokens=int(max_tokens),
            temperature=float(picked.get("temperature", self.temperature)),
            stop=picked.get("stop"),
            seed=picked.get("seed", self.seed),
            recompute=self.recompute,
        )

    def _with_node_spans(self, nodes: list[Node]) -> list[Node]:
        """`nodes` with the documents the current query retrieved cut out as spans, where they appear verbatim
        and it is safe (`prompt_spans.split_at_documents`); the outcome is noted for the call's record."""
        _split_note.set(None)
        record = current_record()
        if self.recover_documents == "off" or record is None or not record.candidates:
            return nodes
        if not all(isinstance(n, (System, User, Assistant)) for n in nodes):
            return nodes
        if not self.get_backend().capabilities.span_aware:
            _split_note.set({"spans": 0, "fallback": "the backend is not span-aware: the prompt was sent as it is"})
            return nodes
        prompt = [PromptMessage(_ROLE_OF[type(n)], [n.text]) for n in nodes]
        split, reason = split_at_documents(prompt, record.candidates, fix=_LLAMAINDEX_FIX)
        if split is None:
            _split_note.set({"spans": 0, "fallback": reason})
            return nodes
        _split_note.set({"spans": span_count(split), "fallback": None})
        return list(query_input(split, span_aware=True, anchor=self.span_anchor).children)

    def _note_call(self, result: ExecutionResult) -> None:
        """The call's usage and span outcome, in the current query's record (for `response.metadata`); the model
        the backend answered with, for `metadata.model_name`."""
        self._served_model = next((c.model for c in reversed(result.calls) if c.model), self._served_model)
        record = current_record()
        if record is None:
            return
        usage = usage_of(result)
        note = _split_note.get() or {"spans": 0, "fallback": None}
        record.note_call({k: usage.get(k) for k in _RECORDED} | note)

    def chat_query(self, messages: Sequence[ChatMessage], **options: Any) -> Generate:
        """The span query of a chat call: one `Generate` over the messages in a `cross`. With `tools` (what
        `chat_with_tools` passes): the tools in the system message, the answer constrained to a call or text.
        Inside a query engine, a chat turn or an agent's run, the nodes retrieved there are sent as spans where
        the prompt holds them verbatim (`recover_documents`): an agent reads its retriever tool's answer so."""
        nodes = self._with_node_spans(messages_to_nodes(messages))
        tools: list[ToolSpec] = options.get("tools") or []
        if not tools:
            return self.generate_call(cross(*nodes), **options)
        choice = check_choice(tools, options.get("tool_choice"))
        instruction = tools_instruction(tools, choice)
        if nodes and isinstance(nodes[0], System):
            nodes[0] = system(f"{nodes[0].text}\n\n{instruction}")
        else:
            nodes.insert(0, system(instruction))
        call = self.generate_call(cross(*nodes), **options)
        schema = reply_schema(tools, choice, parallel=bool(options.get("parallel_tool_calls")))
        return call.model_copy(update={"json_schema": json.dumps(schema)})

    # ----------------------------------------------------------------------------------------- tools

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """What `chat_with_tools` (and LlamaIndex's agents and function-calling programs) send to `chat`."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(user_msg if isinstance(user_msg, ChatMessage) else ChatMessage(role="user", content=user_msg))
        specs = [ToolSpec(t.metadata.name, t.metadata.description or "", t.metadata.get_parameters_dict())
                 for t in tools]
        choice = kwargs.pop("tool_choice", None) or ("required" if tool_required else "auto")
        return {"messages": messages, "tools": specs, "tool_choice": choice,
                "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        calls = _calls_of(response.message)
        if not calls and error_on_no_tool_call:
            why = response.message.additional_kwargs.get("tool_call_error")
            raise ValueError(f"the model called no tool{f': {why}' if why else ''}")
        return [ToolSelection(tool_id=c["id"], tool_name=c["name"], tool_kwargs=c["arguments"]) for c in calls]

    def completion_query(self, prompt: str, **options: Any) -> Generate:
        """The span query of a completion call: the prompt as one user message (this is a chat model)."""
        return self.generate_call(cross(*self._with_node_spans([user(prompt)])), **options)

    async def _execute(
        self,
        query: Node,
        on_token: Any = None,
        tree_reduction: TreeReduction | int | None = None,
    ) -> ExecutionResult:
        from spanq_integrations.optimizer import optimize

        backend = await self.aget_backend()
        # Optimized as `execute` optimizes (sugar such as `chat` and `retrieve` lowered, spans laid out for this
        # backend), with tree reduction only when asked for.
        plan = optimize(query, backend.capabilities, tree_reduction=tree_reduction)
        return await aexecute(plan, backend, optimize=False, on_token=on_token)

    def run_query(self, query: Node, **options: Any) -> ExecutionResult:
        """Execute a span query on this LLM's backend and wait for it.

        `tree_reduction` (a `TreeReduction`, or a fan-in k for a tree of model calls) rewrites wide judges into
        a k-ary tree first (the optimizer's rule 5), as `execute` does. The query is optimized as `execute` does
        it (`chat` and other sugar lowered); without `tree_reduction` no judge is rewritten into a tree."""
        return background_loop().run(self._execute(query, **options))

    async def arun_query(self, query: Node, **options: Any) -> ExecutionResult:
        """`run_query` for async callers."""
        return await background_loop().arun(self._execute(query, **options))

    def stream_query(self, query: Node, **options: Any) -> QueryStream[ExecutionResult]:
        """Iterate the answer's text as it is generated (the run starts on the first `next`); the stream's
        `result` holds the `ExecutionResult` once it is exhausted."""
        return background_loop().stream(lambda on_token: self._execute(query, on_token, **options))

    def astream_query(self, query: Node, **options: Any) -> AsyncQueryStream[ExecutionResult]:
        """`stream_query` for async callers: `async for piece in stream`."""
        return background_loop().astream(lambda on_token: self._execute(query, on_token, **options))

    # ----------------------------------------------------------------------------------------- responses

    @staticmethod
    def _usage_fields(result: ExecutionResult) -> tuple[dict[str, Any], dict[str, Any]]:
        """(additional_kwargs, raw) of a response: OpenAI-style token counts plus spanq's, and all calls."""
        usage = usage_of(result)
        additional = {
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["generated_tokens"],
            "total_tokens": usage["prompt_tokens"] + usage["generated_tokens"],
            "cached_tokens": usage["cached_tokens"],
            # the names LlamaIndex's Anthropic LLM reports prompt caching under: read from the cache, and written
            # to it (the span prepares a later call reads back)
            "cache_read_input_tokens": usage["cached_tokens"],
            "cache_creation_input_tokens": usage["prepared_tokens"],
            "padded_tokens": usage["padded_tokens"],
            "prepared_spans": usage["prepared_spans"],
            "ttft_s": usage["ttft_s"],
        }
        # Why the answer ended, as the engine said ("stop", "length" at max_tokens), where one call answered.
        call = result.answer_call
        if call is not None and call.finish_reason is not None:
            additional["finish_reason"] = call.finish_reason
        raw = {
            METADATA_KEY: usage,
            "usage": result.usage.openai(),  # OpenAI's shape, as LlamaIndex's OpenAI LLM's raw response has it
            "finish_reason": call.finish_reason if call is not None else None,
        }
        return additional, raw

    def _chat_response(self, result: ExecutionResult, tools: Sequence[ToolSpec] = ()) -> ChatResponse:
        self._note_call(result)
        additional, raw = self._usage_fields(result)
        if not tools:
            message = ChatMessage(role=MessageRole.ASSISTANT, content=result.answer)
            return ChatResponse(message=message, raw=raw, additional_kwargs=additional)
        reply = read_reply(result.answer, tools)
        extra: dict[str, Any] = {}
        if reply.error is not None:
            extra["tool_call_error"] = reply.error
        if reply.calls:
            extra["tool_calls"] = [
                {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for c in reply.calls
            ]
        message = ChatMessage(role=MessageRole.ASSISTANT, content=reply.text, additional_kwargs=extra)
        return ChatResponse(message=message, raw=raw, additional_kwargs=additional)

    def _completion_response(self, result: ExecutionResult) -> CompletionResponse:
        self._note_call(result)
        additional, raw = self._usage_fields(result)
        return CompletionResponse(text=result.answer, raw=raw, additional_kwargs=additional)

    # ----------------------------------------------------------------------------------------- chat

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat_response(self.run_query(self.chat_query(messages, **kwargs)), kwargs.get("tools") or ())

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        await self.aget_backend()  # (building the query asks the backend what it can do)
        result = await self.arun_query(self.chat_query(messages, **kwargs))
        return self._chat_response(result, kwargs.get("tools") or ())

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        if kwargs.get("tools"):  # a tool call's JSON comes whole: one response
            response = self._chat_response(self.run_query(self.chat_query(messages, **kwargs)), kwargs["tools"])
            response.delta = response.message.content or ""  # the whole text is this one response's delta

            def one() -> ChatResponseGen:  # a generator: LlamaIndex's callback wrapper takes any other as a response
                yield response

            return one()
        stream = self.stream_query(self.chat_query(messages, **kwargs))

        def gen() -> ChatResponseGen:
            text = ""
            for piece in stream:
                text += piece
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=piece)
            final = self._chat_response(stream.result)
            final.delta = ""  # the last chunk carries the usage; its text came before
            yield final

        return gen()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        await self.aget_backend()
        if kwargs.get("tools"):  # a tool call's JSON comes whole: one response
            whole = self._chat_response(await self.arun_query(self.chat_query(messages, **kwargs)), kwargs["tools"])
            whole.delta = whole.message.content or ""

            async def one() -> ChatResponseAsyncGen:
                yield whole

            return one()
        stream = self.astream_query(self.chat_query(messages, **kwargs))

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async for piece in stream:
                text += piece
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=piece)
            final = self._chat_response(stream.result)
            final.delta = ""
            yield final

        return gen()

    # ----------------------------------------------------------------------------------------- completion

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._completion_response(self.run_query(self.completion_query(prompt, **kwargs)))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        await self.aget_backend()
        return self._completion_response(await self.arun_query(self.completion_query(prompt, **kwargs)))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        stream = self.stream_query(self.completion_query(prompt, **kwargs))

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in stream:
                text += piece
                yield CompletionResponse(text=text, delta=piece)
            final = self._completion_response(stream.result)
            final.delta = ""
            yield final

        return gen()

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        await self.aget_backend()
        stream = self.astream_query(self.completion_query(prompt, **kwargs))

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for piece in stream:
                text += piece
                yield CompletionResponse(text=text, delta=piece)
            final = self._completion_response(stream.result)
            final.delta = ""
            yield final

        return gen()


install_tracker()  # the nodes each query retrieves, for `recover_documents` (one event handler per process)
