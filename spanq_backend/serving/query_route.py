"""`spanq serve`'s added routes: `POST /v1/query/execute` (a span query in spnl JSON, run whole by the executor on
`EngineClientBackend`; answered with the closed tree and usage, or streamed as `chat.completion.chunk` events with
`?stream=true`, which is what `SpanBackend` reads) and `GET /v1/spans` (the digests of the spans the engine holds).
Client mistakes are 4xx naming what is wrong; anything else is a 500 with an incident id."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

# module level: FastAPI resolves the route's annotations here
from fastapi import Depends, Request

from spanq_backend.serving.engine_client import EngineClientBackend
from spanq_backend.serving.generator import ISOLATE_MIN_TOKENS, LEAD_IN_NEUTRAL
from spanq_backend.serving.lowering import DEFAULT_ANCHOR
from spanq_backend.serving.recompute import DEFAULT_RECOMPUTE
from spanq_backend.serving.request_body import Oversized, body_too_large, read_capped
from spanq_backend.serving.spnl_wire import choices_of, spnl_chunk, spnl_response, wire_format
from spanq_backend.vllm_integration.support import aquery_span_support
from spanq_integrations.backends.span import EXECUTE_PATH  # the route spnl's patched vLLM exposes
from spanq_integrations.query.errors import (
    BackendError,
    BackendUnavailableError,
    ContextLengthError,
    GenerationError,
    ModelNotFoundError,
    OptimizerError,
    QueryParseError,
    QueryValidationError,
    ReducerParseError,
    RequestRejectedError,
    SpanQueryError,
)
from spanq_integrations.query.ir import AnchorPolicy, Map, Node, Recompute
from spanq_integrations.query.limits import (
    DEFAULT_LIMITS,
    QueryLimitError,
    QueryLimits,
    check_json_depth,
    check_limits,
)
from spanq_integrations.query.spnl_json import from_json, refuse_a_string, to_json
from spanq_integrations.runtime.executor import ExecutionResult, aexecute

__all__ = [
    "EXECUTE_PATH", "PIN_PATH", "SPANS_PATH", "QueryRun", "build_query_router", "error_body", "parse_documents",
    "parse_query",
]

log = logging.getLogger("spanq.server")

SPANS_PATH = "/v1/spans"  # GET: the digests of the spans whose KV the engine holds
PIN_PATH = "/v1/spans/pin"  # GET: how many blocks are pinned; DELETE: drop every pin (POST /v1/spans pins)


# HTTP status and error type for each spanq error a query can meet (subclasses before their bases).
_ERROR_STATUS: tuple[tuple[type[SpanQueryError], int], ...] = (
    (QueryParseError, 400),
    (QueryValidationError, 400),
    (OptimizerError, 400),
    (ReducerParseError, 500),
    (ModelNotFoundError, 404),
    (ContextLengthError, 400),
    (RequestRejectedError, 400),
    (BackendUnavailableError, 503),
    (BackendError, 500),
    (GenerationError, 500),
    (SpanQueryError, 500),
)


def error_body(error: BaseException) -> tuple[int, dict[str, Any]]:
    """HTTP status and OpenAI-shaped body `{"error": {"message", "type", "code"}}` for a failure."""
    if isinstance(error, GenerationError) and isinstance(error.cause, SpanQueryError):
        error = error.cause  # a call's own typed failure decides the status
    if not isinstance(error, GenerationError):
        for cls, status in _ERROR_STATUS:
            if isinstance(error, cls):
                return status, {"error": {"message": str(error), "type": type(error).__name__, "code": status}}
    # Anything else is the server's own fault: its text stays in the log, the client gets an id to quote.
    incident = uuid.uuid4().hex[:12]
    where = f" at {error.path}" if isinstance(error, GenerationError) else ""
    log.error("query failed (incident %s)", incident, exc_info=error)
    message = f"internal error{where} (incident {incident}); the server's log has the details"
    return 500, {"error": {"message": message, "type": "InternalServerError", "code": 500}}


def usage_of(result: ExecutionResult) -> dict[str, Any]:
    """The query's usage in OpenAI's shape, with spanq's padded tokens, prepared spans and span fallback."""
    return result.usage.openai()


NO_RETRIEVER = "this server has no retriever: retrieve the documents first and send them as fragments of a plus"


def _not_json(e: ValueError) -> str:
    """Why a body is not JSON, in the client's terms: Python's refusal of a huge integer literal tells the reader to
    raise an interpreter limit (`sys.set_int_max_str_digits`), which is the server's to set, not the client's."""
    if "integer string conversion" in str(e):
        return f"a number in it has more than {sys.get_int_max_str_digits()} digits"
    return str(e)


def parse_query(body: bytes, limits: QueryLimits = DEFAULT_LIMITS) -> Node:
    """The span query in a request body, within `limits`; a `QueryParseError` naming the JSON path if it is not
    one, a `QueryLimitError` naming the limit if it asks for too much. Nothing else runs before this passes."""
    if len(body) > limits.max_body_bytes:
        raise body_too_large(limits, len(body))
    try:
        doc = json.loads(body)
    except RecursionError:
        raise QueryLimitError(
            "$", f"the body is nested too deeply: over the limit max_depth={limits.max_depth} (spanq serve --max-depth)"
        ) from None
    except ValueError as e:
        raise QueryParseError(
            "$", f"the request body is not JSON ({_not_json(e)}); send a span query in spnl JSON"
        ) from e
    refuse_a_string(doc, "send")
    check_json_depth(doc, limits)
    query = from_json(doc)
    # (a retrieve is refused in the limits' walk: the optimizer's own error says how to register one in Python)
    check_limits(query, limits, no_retrieve=NO_RETRIEVER)
    return query


def parse_documents(body: bytes, limits: QueryLimits = DEFAULT_LIMITS) -> tuple[list[str], bool]:
    """The documents of a `POST /v1/spans` body, `{"documents": [...], "pin": false}`, each a string or an object
    with its text under `text`, `page_content` or `content` (a corpus line of `spanq prepare`), at most
    `max_fragments` of them; and whether to pin them. A `QueryParseError` naming the first thing that is wrong."""
    from spanq_backend.serving.corpus import unicode_problem
    from spanq_backend.serving.prepare import TEXT_KEYS, text_of

    shape = '{"documents": ["text", ...], "pin": true|false}'
    if len(body) > limits.max_body_bytes:
        raise body_too_large(limits, len(body))
    try:
        doc = json.loads(body)
    except RecursionError:
        raise QueryParseError("$", f"the body is nested too deeply; send {shape}") from None
    except ValueError as e:
        raise QueryParseError("$", f"the request body is not JSON ({_not_json(e)}); send {shape}") from e
    if not isinstance(doc, dict):
        raise QueryParseError("$", f"expected a JSON object: send {shape}")
    unknown = sorted(set(doc) - {"documents", "pin"})
    if unknown:
        raise QueryParseError(f"$.{unknown[0]}", f"unknown field; send {shape}")
    pin = doc.get("pin", False)
    if not isinstance(pin, bool):
        raise QueryParseError("$.pin", f"expected true or false, got {json.dumps(pin)[:40]}")
    documents, where = doc.get("documents"), "$.documents"
    if not isinstance(documents, list) or not documents:
        raise QueryParseError(where, f"expected a non-empty list of documents: send {shape}")
    if len(documents) > limits.max_fragments:
        raise QueryLimitError(where, f"{len(documents)} documents: over the limit max_fragments={limits.max_fragments} "
                              "(spanq serve --max-fragments); send them in several requests")
    texts = []
    for i, item in enumerate(documents):
        text = text_of(item)
        if text is None:
            keys = ", ".join(TEXT_KEYS)
            raise QueryParseError(f"{where}[{i}]", f"not a document: a non-blank string, or an object with its text "
                                  f"under {keys}")
        if (bad := unicode_problem(text)) is not None:
            raise QueryParseError(f"{where}[{i}]", bad)
        texts.append(text)
    return texts, pin


_END = object()
METRICS_WAIT_S = 1.0  # the most a /metrics scrape waits for the engine's counters (`before_metrics`)


class QueryRun:
    """One query running in the background for a streaming answer: its tokens on a queue, then its result."""

    def __init__(self, backend: EngineClientBackend, query: Node, model: str, wire: str = "spanq"):
        self.backend = backend
        self.model = model
        self.wire = wire  # "spanq": chat.completion.chunk events; "spnl": text_completion chunks (spnl_wire)
        self.id = f"{'cmpl' if wire == 'spnl' else 'chatcmpl'}-spanq-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.pieces: asyncio.Queue[Any] = asyncio.Queue()  # (index of the answer, a piece of its text), then _END
        self.streamed: set[int] = set()  # the answers some text of which was sent
        self.task = asyncio.ensure_future(  # every answer of a bulk query streams by its index, as its call runs
            aexecute(query, backend, optimize=True, on_answer_token=lambda k, piece: self.pieces.put_nowait((k, piece)))
        )
        self.task.add_done_callback(lambda _: self.pieces.put_nowait(_END))
        self.first: Any = None

    async def start(self) -> None:
        """Wait for the first token, or for the end if it fails (or finishes) before producing one."""
        self.first = await self.pieces.get()

    def failed_early(self) -> BaseException | None:
        if self.first is _END and not self.task.cancelled():
            return self.task.exception()
        return None

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def _delta(self, index: int, piece: str) -> str:
        self.streamed.add(index)
        if self.wire == "spnl":
            return spnl_chunk(self.id, self.created, self.model, [(index, piece, None)])
        return self._chunk([{"index": index, "delta": {"content": piece}, "finish_reason": None}])

    def _final(self, result: ExecutionResult) -> str:
        """Every choice's finish reason, and its text where none of it streamed: a call's other choices (n > 1),
        a bulk answer's (`repeat`, `map`, a `plus` of calls) other than each call's first, a combined answer."""
        choices = choices_of(result)
        if self.wire == "spnl":
            rest = [(k, "" if k in self.streamed else text, reason) for k, (text, reason) in enumerate(choices)]
            return spnl_chunk(self.id, self.created, self.model, rest, usage=usage_of(result))
        stop = "stop" if result.answer_call is None else None  # (a bulk answer stopped, where no reason is known)
        return self._chunk([
            {"index": k, "delta": {"content": text} if text and k not in self.streamed else {},
             "finish_reason": reason or stop}
            for k, (text, reason) in enumerate(choices)
        ], usage=usage_of(result))  # fmt: skip

    async def events(self) -> AsyncIterator[str]:
        try:
            item = self.first
            while item is not _END:
                yield self._delta(*item)
                item = await self.pieces.get()
            try:
                result = self.task.result()
            except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - sent to the client as an error event
                _, body = error_body(e)
                yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
            else:
                yield self._final(result)
            yield "data: [DONE]\n\n"
        finally:
            await self.cancel()

    async def cancel(self) -> None:
        """Stop the query (its engine requests are aborted) if it is still running."""
        if not self.task.done():
            self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task


def build_query_router(
    tokenizer: Any,
    served_model_names: Sequence[str],
    limits: QueryLimits = DEFAULT_LIMITS,
    default_anchor: AnchorPolicy = DEFAULT_ANCHOR,
    default_recompute: Recompute = DEFAULT_RECOMPUTE,
    default_lead_in: str = LEAD_IN_NEUTRAL,
    cold_spans: str = "auto",
    isolate_min_tokens: int = ISOLATE_MIN_TOKENS,
    read_in_context: bool = True,
    keep_span_order: bool = False,
) -> Any:
    """The FastAPI router of `POST /v1/query/execute`, for an app whose state holds vLLM's engine client."""
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse, StreamingResponse
    from vllm.entrypoints.serve.utils.api_utils import with_cancellation

    router = APIRouter()
    started = asyncio.Lock()

    async def backend_of(request: Request) -> EngineClientBackend:
        return await backend_of_app(request.app)

    async def backend_of_app(app: Any) -> EngineClientBackend:
        state = app.state
        async with started:
            backend = getattr(state, "spanq_backend", None)
            if backend is not None:
                return backend
            config = state.vllm_config
            from spanq_backend.vllm_integration.cache_probe import KVEventsMirror

            support = await aquery_span_support(state.engine_client.collective_rpc)
            if not support.enabled:
                log.warning("spanq serve: spans are off for this engine; queries run as stock: %s", support.reason)
            mirror = state.spanq_kv_mirror = KVEventsMirror.for_engine(config) if support.enabled else None
            transfer = getattr(config, "kv_transfer_config", None)
            if mirror is not None and transfer is not None and transfer.kv_connector == "SpanTierConnector":
                from spanq_backend.vllm_integration.tier import tier_for

                mirror.tier = tier_for(transfer.kv_connector_extra_config["tier_dir"], config)
            backend = EngineClientBackend(
                state.engine_client,
                tokenizer,
                served_model_names=served_model_names,
                block_size=config.cache_config.block_size,
                max_model_len=config.model_config.max_model_len,
                max_concurrency=config.scheduler_config.max_num_seqs,
                span_probe=mirror,
                span_support=support,
                default_anchor=default_anchor,
                default_recompute=default_recompute,
                default_lead_in=default_lead_in,
                cold_spans=cold_spans,
                isolate_min_tokens=isolate_min_tokens,
                read_in_context=read_in_context,
                keep_span_order=keep_span_order,
            )
            backend.generator.outside_requests = getattr(state, "spanq_outside_requests", 0)
            if not support.unanswered:  # kept; workers that could not be asked are asked again next query
                state.spanq_backend = backend
        return backend

    async def refresh_engine_counters(backend: EngineClientBackend) -> None:
        """Read the engine processes' span counters for /metrics (after each query; never fails a query)."""
        from spanq_backend.serving import metrics
        from spanq_backend.vllm_integration.support import WORKER_STATS_METHOD

        try:
            metrics.set_engine_stats(list(await backend.engine_client.collective_rpc(WORKER_STATS_METHOD)))
        except Exception as e:  # noqa: BLE001  (counters are best effort; the answer is what matters)
            log.debug("could not read the engine's span counters: %s", e)

    refreshing: list[asyncio.Task[None]] = []  # the one refresh a scrape started, while it runs
    creating: list[asyncio.Task[EngineClientBackend]] = []  # the backend a scrape before any query started

    async def before_metrics(app: Any) -> None:
        """/metrics shows the engine processes' counters as of the scrape, not of the last query: what a server
        does after its answers (deferred prepares, their tier writes) came after that query's refresh. The engine
        core answers between two steps, which on a CPU can be seconds apart: a scrape waits `METRICS_WAIT_S` at
        most (then shows the last counters read; the refresh goes on, for the next scrape), and scrapes meanwhile
        share one refresh."""
        backend = getattr(app.state, "spanq_backend", None)
        if backend is None:  # no query yet: the engine's counters (its tier's among them) are shown from the first
            # scrape on, not from the first query; made once, in the background if it takes longer than a scrape waits
            if not creating or (creating[0].done() and creating[0].exception() is not None):
                creating[:] = [asyncio.ensure_future(backend_of_app(app))]
            try:
                backend = await asyncio.wait_for(asyncio.shield(creating[0]), METRICS_WAIT_S)
            except Exception as e:  # noqa: BLE001  (a scrape never fails for it; the next one tries again)
                log.debug("the span backend is not ready for /metrics: %s", e)
                return
        if not refreshing or refreshing[0].done():
            refreshing[:] = [asyncio.ensure_future(refresh_engine_counters(backend))]
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(refreshing[0]), METRICS_WAIT_S)

    router.spanq_before_metrics = before_metrics  # (`frontend.query_route_mounted` runs it before each scrape)

    def engine_request(app: Any, started: bool) -> None:
        """A request of the engine's other routes (a stock chat completion) started or ended: the span backend's
        deferred prepares wait while any runs. Counted from the server's start (a backend made meanwhile, at the
        first query, starts from the count)."""
        state = app.state
        state.spanq_outside_requests = max(0, getattr(state, "spanq_outside_requests", 0) + (1 if started else -1))
        backend = getattr(state, "spanq_backend", None)
        if backend is not None:
            backend.generator.outside_request(started)

    router.spanq_engine_request = engine_request  # (`frontend.query_route_mounted` runs it around those requests)

    async def read_body(request: Request) -> bytes | Oversized:
        """The body, read before the handler runs (`with_cancellation` then listens on the connection for a
        disconnect), within `max_body_bytes` (`request_body.read_capped`)."""
        return await read_capped(request, limits.max_body_bytes)

    def error_response(error: BaseException) -> JSONResponse:
        status, body = error_body(error)
        return JSONResponse(body, status_code=status)

    class QueryEventStream(StreamingResponse):
        """The SSE answer; stops the query however the response ends (also if it never starts streaming)."""

        def __init__(self, run: QueryRun):
            super().__init__(
                run.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
            self.run = run

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.run.cancel()
                await refresh_engine_counters(self.run.backend)

    @router.get(SPANS_PATH)
    async def cached_spans(raw_request: Request) -> Any:
        """Which spans this server's engine still holds: digests of their texts (`lowering.span_digest`), of the
        spans it prepared, most recently used last; with a span tier, which of them the tier holds (`tier`: any
        engine on that folder loads them) and which folder it is (`tier_id`). What a cluster's span-affinity router
        routes on."""
        backend = await backend_of(raw_request)
        generator = backend.generator
        return JSONResponse({
            "spans": generator.cached_span_digests(), "probe": generator.span_probe is not None,
            "tier": generator.tier_span_digests(), "tier_id": generator.tier_identity(),
        })

    async def pin_call(backend: EngineClientBackend, method: str, *args: Any) -> Any:
        """One of the plugin's engine core methods (`vllm_integration.engine_core`), between two engine steps."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            return await backend.engine_client.engine_core.call_utility_async(method, *args)
        except EngineDeadError as e:
            raise BackendUnavailableError(f"the server's engine has stopped: {e}") from e

    @router.post(SPANS_PATH)
    @with_cancellation
    async def prepare_documents(raw_request: Request, body: bytes | Oversized = Depends(read_body)) -> Any:  # noqa: B008
        """Prepare each document's span, as a query's `plus` of it is prepared (those cached already are not; with a
        span tier, the tier saves them), so that later queries over them find them; with `"pin": true`, pin their
        blocks in the engine's KV cache too: they stay there whatever else runs, until `DELETE /v1/spans/pin` (at
        most half the cache is pinned: the rest are counted `pin_refused`). Answers the report of
        `serving/corpus.compile_corpus`; pinning, with the blocks pinned in all (`pinned_total`)."""
        from spanq_backend.serving.corpus import compile_corpus
        from spanq_backend.vllm_integration.engine_core import PIN_METHOD, PINNED_METHOD

        backend = await backend_of(raw_request)
        if isinstance(body, Oversized):
            return error_response(body_too_large(limits, body))
        try:
            texts, pinning = parse_documents(body, limits)
            generator = backend.generator
            if generator.span_probe is None:
                raise RequestRejectedError(
                    "this server cannot prepare spans: its spans are off, or its prefix cache cannot be followed here"
                    + (f" ({generator.fallback})" if generator.fallback else "")
                )

            async def pin(hashes: list[Any]) -> dict[str, int]:
                return dict(await pin_call(backend, PIN_METHOD, [bytes(h) for h in hashes]))

            report, _ = await compile_corpus(generator, texts, pin=pin if pinning else None,
                                             skip_tier_held=not pinning)  # fmt: skip
            if pinning:
                report["pinned_total"] = int(await pin_call(backend, PINNED_METHOD))
        except Exception as e:  # noqa: BLE001 - every failure becomes an error answer
            return error_response(e)
        finally:
            await refresh_engine_counters(backend)
        log.info("prepared %d of %d documents%s", report["prepared"], len(texts),
                 f", {report['pinned_blocks']} blocks pinned ({report['pinned_total']} in all)" if pinning else "")
        return JSONResponse(report)

    async def pin_count(raw_request: Request, method: str, key: str) -> Any:
        """`{key: n}`, n the block count an engine core pin method answers; or the error's answer."""
        backend = await backend_of(raw_request)
        try:
            return JSONResponse({key: int(await pin_call(backend, method))})
        except Exception as e:  # noqa: BLE001
            return error_response(e)

    @router.delete(PIN_PATH)
    async def unpin_documents(raw_request: Request) -> Any:
        """Drop every pin: the blocks stay cached, evicted as any other from now on. How many."""
        from spanq_backend.vllm_integration.engine_core import UNPIN_METHOD

        return await pin_count(raw_request, UNPIN_METHOD, "unpinned_blocks")

    @router.get(PIN_PATH)
    async def pinned(raw_request: Request) -> Any:
        """How many blocks of the engine's KV cache are pinned now."""
        from spanq_backend.vllm_integration.engine_core import PINNED_METHOD

        return await pin_count(raw_request, PINNED_METHOD, "pinned_blocks")

    @router.post(EXECUTE_PATH)
    @with_cancellation
    async def execute_query(
        raw_request: Request,
        stream: bool = False,
        format: str | None = None,  # the query parameter `?format=`
        body: bytes | Oversized = Depends(read_body),  # noqa: B008  (FastAPI's way to read it first)
    ) -> Any:
        """Run a span query (spnl JSON); `?stream=true` streams the answer. `?format=spanq` (spanq's client):
        the closed tree and per-call metrics, or chat.completion.chunk events; `?format=spnl`, or a text/plain
        body without a format (spnl's client): OpenAI completion objects, or text_completion chunks."""
        backend = await backend_of(raw_request)
        if isinstance(body, Oversized):
            return error_response(body_too_large(limits, body))
        try:
            wire = wire_format(format, raw_request.headers.get("content-type"))
            # (on a thread: reading an 8 MiB document takes a moment other requests need not wait for)
            query = await asyncio.to_thread(parse_query, body, limits) if len(body) > 1 << 16 else parse_query(body, limits)
            backend.check_models(query)
        except SpanQueryError as e:
            return error_response(e)
        if not stream:
            try:
                result = await aexecute(query, backend, optimize=True)
            except Exception as e:  # noqa: BLE001 - every failure becomes an error answer
                return error_response(e)
            finally:
                await refresh_engine_counters(backend)
            if wire == "spnl":
                return JSONResponse(
                    spnl_response(
                        query,
                        result,
                        request_id=f"{'cmpl' if isinstance(query, Map) else 'chatcmpl'}-spanq-{uuid.uuid4().hex}",
                        created=int(time.time()),
                        model=served_model_names[0],
                    )
                )
            return JSONResponse(
                {
                    "result": to_json(result.tree),
                    "answer": result.answer,
                    "usage": usage_of(result),
                    "calls": [c.model_dump() for c in result.calls],
                    "unread": [u.model_dump() for u in result.unread],
                }
            )
        run = QueryRun(backend, query, served_model_names[0], wire)
        handed_over = False
        try:
            await run.start()
            failure = run.failed_early()
            if failure is not None:
                return error_response(failure)
            handed_over = True
            return QueryEventStream(run)
        finally:
            if not handed_over:
                await run.cancel()

    return router
