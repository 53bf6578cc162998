"""`SpanQuerySynthesizer`: a LlamaIndex response synthesizer that hands every retrieved node to the model as its
own order-free span.

LlamaIndex's built-in synthesizers pack the nodes' texts into one merged context string before the model sees
it, so the same node retrieved for two questions (or in another rank) is new text each time. This one builds

    generate(cross(system(instructions), plus(fragment(node.text, id=node.node_id), …), user(question)))

and runs it on the LLM's backend: on a span-aware backend each node's KV is computed once, on its own, and
reused at any position and in any order by later queries. On an ordinary OpenAI-compatible server the nodes are
sent as separate text blocks (no reuse, same answers).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
from llama_index.core.prompts import PromptTemplate
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, QueryType
from llama_index.core.settings import Settings
from llama_index.core.types import RESPONSE_TEXT_TYPE

from spanq_integrations.llamaindex.llm import SpanQueryLLM
from spanq_integrations.llamaindex.usage import METADATA_KEY, usage_of
from spanq_integrations.query.errors import ContextLengthError, QueryValidationError
from spanq_integrations.query.ir import AnchorPolicy, Fragment, Generate, cross, fragment, plus, system, user
from spanq_integrations.runtime.executor import ExecutionResult

__all__ = [
    "DEFAULT_QUERY_TEMPLATE",
    "DEFAULT_SYSTEM_PROMPT",
    "NoNodesError",
    "SpanQuerySynthesizer",
    "span_query_llm",
]

dispatcher = get_dispatcher(__name__)

DEFAULT_SYSTEM_PROMPT = (
    "You are a question-answering assistant. Answer the question using only the context documents that "
    "follow, not prior knowledge. The documents come in no particular order. If they do not contain the "
    "answer, say that you do not know. Be brief."
)
DEFAULT_QUERY_TEMPLATE = "Question: {query_str}"


class NoNodesError(QueryValidationError):
    """The synthesizer was given no nodes (or only empty ones) and was asked to raise rather than answer."""

    def __init__(self, message: str):
        super().__init__("nodes", message)


def _checked_nodes(nodes: Any, name: str) -> list[NodeWithScore]:
    """The retrieved nodes as `NodeWithScore`s (a bare node is wrapped, as a retriever would return it); an
    `ArgumentTypeError` naming the argument for anything else."""
    from llama_index.core.schema import BaseNode

    from spanq_integrations.query.errors import ArgumentTypeError

    if isinstance(nodes, (str, BaseNode, NodeWithScore)) or nodes is None or not hasattr(nodes, "__iter__"):
        raise ArgumentTypeError(f"synthesize({name})", f"takes a list of NodeWithScore (a retriever's output), got "
                                f"{type(nodes).__name__}")
    checked = []
    for i, n in enumerate(nodes):
        if isinstance(n, BaseNode):
            n = NodeWithScore(node=n)
        if not isinstance(n, NodeWithScore):
            raise ArgumentTypeError(f"synthesize({name}[{i}])", f"takes NodeWithScore (a retriever's output) or a "
                                    f"node, got {type(n).__name__}")
        checked.append(n)
    return checked


def span_query_llm(llm: Any) -> SpanQueryLLM:
    """`llm` if it is a `SpanQueryLLM`; `Settings.llm` if that is one; a new one on the embedded default."""
    if isinstance(llm, SpanQueryLLM):
        return llm
    if llm is not None:
        raise TypeError(
            f"the spanq synthesizers and judges need a SpanQueryLLM (it runs the span query), got "
            f"{type(llm).__name__}; wrap your server: SpanQueryLLM(backend='http://host:port')"
        )
    configured = getattr(Settings, "_llm", None)
    return configured if isinstance(configured, SpanQueryLLM) else SpanQueryLLM()


class SpanQuerySynthesizer(BaseSynthesizer):
    """Answers a query over retrieved nodes in one model call, each node its own commutative span.

    Use it as `index.as_query_engine(llm=llm, response_synthesizer=SpanQuerySynthesizer(llm=llm))` or in a
    `RetrieverQueryEngine`. The response carries its source nodes and, under `metadata["spanq"]`, the run's
    usage: calls, prompt / cached / padded / generated tokens, prepared spans, TTFT and wall time.

    No nodes (or only empty ones): like LlamaIndex's own synthesizers, the answer is `empty_response`
    ("Empty Response") without a model call, and `metadata["spanq"]["calls"]` is 0; with `raise_on_empty=True`
    a `NoNodesError` is raised instead. A node that does not fit the context window raises a
    `ContextLengthError` that names it.
    """

    def __init__(
        self,
        llm: SpanQueryLLM | None = None,
        *,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        query_template: str = DEFAULT_QUERY_TEMPLATE,
        max_tokens: int | None = None,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
        empty_response: str | None = None,
        raise_on_empty: bool = False,
        metadata_mode: MetadataMode = MetadataMode.LLM,
        span_anchor: AnchorPolicy | None = None,
    ) -> None:
        """`span_anchor`: what each node's KV is computed after (see `spanq_integrations.plus`); None is the LLM's
        (`SpanQueryLLM.span_anchor`, whose None is the backend's default); "template": a node is reused whatever
        question or system prompt precedes it."""
        span_llm = span_query_llm(llm)
        super().__init__(
            llm=span_llm,
            callback_manager=callback_manager,
            streaming=streaming,
            empty_response=empty_response,
        )
        self._span_llm = span_llm
        self._system_prompt = system_prompt
        self._query_template = query_template
        self._max_tokens = max_tokens
        self._raise_on_empty = raise_on_empty
        self._metadata_mode = metadata_mode
        self._span_anchor = span_anchor

    # ----------------------------------------------------------------------------------------- prompts

    def _get_prompts(self) -> PromptDictType:
        return {
            "system_prompt": PromptTemplate(self._system_prompt),
            "query_template": PromptTemplate(self._query_template),
        }

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if "system_prompt" in prompts:
            self._system_prompt = prompts["system_prompt"].get_template()
        if "query_template" in prompts:
            self._query_template = prompts["query_template"].get_template()

    # ----------------------------------------------------------------------------------------- the query

    def node_fragments(self, nodes: Sequence[NodeWithScore]) -> list[Fragment]:
        """One fragment per node with text, in the order given, each carrying its node id."""
        fragments = []
        for n in nodes:
            text = n.node.get_content(metadata_mode=self._metadata_mode)
            if text.strip():
                fragments.append(fragment(text, id=n.node.node_id))
        return fragments

    def build_query(self, query_str: str, fragments: Sequence[Fragment | str]) -> Generate:
        """The span query of one answer: the instructions, the fragments as a `plus`, then the question."""
        return self._span_llm.generate_call(
            cross(
                system(self._system_prompt),
                plus(*fragments, anchor=self._span_anchor or self._span_llm.span_anchor),
                user(self._query_template.format(query_str=query_str)),
            ),
            max_tokens=self._max_tokens,
        )

    def _run_options(self) -> dict[str, Any]:
        """Extra options of `SpanQueryLLM.run_query` (the tree synthesizer turns on tree reduction)."""
        return {}

    # ----------------------------------------------------------------------------------------- errors

    @contextmanager
    def _naming_nodes(self, fragments: Sequence[Fragment]) -> Iterator[None]:
        """Re-raise a context-length error with the node it is about, and what to do."""
        try:
            yield
        except ContextLengthError as e:
            raise ContextLengthError(self._context_advice(str(e), fragments)) from e

    def _context_advice(self, message: str, fragments: Sequence[Fragment]) -> str:
        found = re.search(r"\bspan (\d+)\b", message)
        if found and int(found.group(1)) < len(fragments):
            node_id = fragments[int(found.group(1))].id
            return (
                f"node {node_id!r} is too long for the model's context window on its own ({message}); split "
                "the documents into smaller nodes, e.g. SentenceSplitter(chunk_size=256)"
            )
        return (
            f"the {len(fragments)} retrieved nodes do not fit the model's context window together ({message}); "
            "retrieve fewer (similarity_top_k), lower max_tokens, or use SpanQueryTreeSynthesizer, which reads "
            "k nodes per call"
        )

    # ----------------------------------------------------------------------------------------- responses

    def _response_metadata(self, nodes: Sequence[NodeWithScore]) -> dict[str, Any]:
        return {n.node.node_id: n.node.metadata for n in nodes}

    def _empty(self, source_nodes: list[NodeWithScore], asynchronous: bool) -> RESPONSE_TYPE:
        if self._raise_on_empty:
            raise NoNodesError(
                "no nodes to answer from: the retriever found nothing (or only empty nodes); check the index "
                "and the query, or pass raise_on_empty=False to answer with empty_response"
            )
        metadata = {METADATA_KEY: {"calls": 0, "no_nodes": True}}
        if not self._streaming:
            return Response(self._empty_response, source_nodes=source_nodes, metadata=metadata)
        if asynchronous:
            return AsyncStreamingResponse(
                self._empty_response_agenerator(), source_nodes=source_nodes, metadata=metadata
            )
        return StreamingResponse(
            self._empty_response_generator(), source_nodes=source_nodes, metadata=metadata
        )

    def _answer(
        self, query_str: str, fragments: list[Fragment], metadata: dict[str, Any]
    ) -> RESPONSE_TEXT_TYPE:
        """The answer text (or, when streaming, a generator of its pieces); fills `metadata` with the usage."""
        query = self.build_query(query_str, fragments)
        options = self._run_options()
        if self._streaming:
            stream = self._span_llm.stream_query(query, **options)

            def pieces() -> Iterator[str]:
                with self._naming_nodes(fragments):
                    yield from stream
                metadata[METADATA_KEY] = usage_of(stream.result)

            return pieces()
        with self._naming_nodes(fragments):
            result: ExecutionResult = self._span_llm.run_query(query, **options)
        metadata[METADATA_KEY] = usage_of(result)
        return result.answer

    async def _aanswer(
        self, query_str: str, fragments: list[Fragment], metadata: dict[str, Any]
    ) -> RESPONSE_TEXT_TYPE:
        query = self.build_query(query_str, fragments)
        options = self._run_options()
        if self._streaming:
            stream = self._span_llm.astream_query(query, **options)

            async def pieces() -> AsyncIterator[str]:
                with self._naming_nodes(fragments):
                    async for piece in stream:
                        yield piece
                metadata[METADATA_KEY] = usage_of(stream.result)

            return pieces()
        with self._naming_nodes(fragments):
            result = await self._span_llm.arun_query(query, **options)
        metadata[METADATA_KEY] = usage_of(result)
        return result.answer

    @staticmethod
    def _wrap(answer: Any, source_nodes: list[NodeWithScore], metadata: dict[str, Any]) -> RESPONSE_TYPE:
        if isinstance(answer, str):
            return Response(answer, source_nodes=source_nodes, metadata=metadata)
        if isinstance(answer, Iterator):
            return StreamingResponse(answer, source_nodes=source_nodes, metadata=metadata)
        return AsyncStreamingResponse(answer, source_nodes=source_nodes, metadata=metadata)

    def _start(
        self, query: QueryType, nodes: list[NodeWithScore], additional: Sequence[NodeWithScore] | None
    ) -> tuple[QueryBundle, list[NodeWithScore], list[Fragment]]:
        """What `synthesize` and `asynthesize` share before answering: the query bundle (start event sent),
        the source nodes to return, and the nodes' fragments."""
        nodes, additional = _checked_nodes(nodes, "nodes"), _checked_nodes(additional or (), "additional_source_nodes")
        bundle = QueryBundle(query_str=query) if isinstance(query, str) else query
        dispatcher.event(SynthesizeStartEvent(query=bundle))
        return bundle, nodes + additional, self.node_fragments(nodes)

    # ----------------------------------------------------------------------------------------- LlamaIndex API

    @dispatcher.span
    def synthesize(
        self,
        query: QueryType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        bundle, source_nodes, fragments = self._start(query, nodes, additional_source_nodes)
        if not fragments:
            response = self._empty(source_nodes, asynchronous=False)
        else:
            with self._callback_manager.event(
                CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: bundle.query_str}
            ) as event:
                metadata = self._response_metadata(source_nodes)
                answer = self._answer(bundle.query_str, fragments, metadata)
                response = self._wrap(answer, source_nodes, metadata)
                event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=bundle, response=response))
        return response

    @dispatcher.span
    async def asynthesize(
        self,
        query: QueryType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        bundle, source_nodes, fragments = self._start(query, nodes, additional_source_nodes)
        if not fragments:
            response = self._empty(source_nodes, asynchronous=True)
        else:
            with self._callback_manager.event(
                CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: bundle.query_str}
            ) as event:
                metadata = self._response_metadata(source_nodes)
                answer = await self._aanswer(bundle.query_str, fragments, metadata)
                response = self._wrap(answer, source_nodes, metadata)
                event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=bundle, response=response))
        return response

    def get_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """LlamaIndex's text-chunk entry point: each chunk becomes its own span (without a node id)."""
        fragments = [fragment(t) for t in text_chunks if t.strip()]
        if not fragments:
            return self._empty_response
        return self._answer(query_str, fragments, {})

    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        fragments = [fragment(t) for t in text_chunks if t.strip()]
        if not fragments:
            return self._empty_response
        return await self._aanswer(query_str, fragments, {})
