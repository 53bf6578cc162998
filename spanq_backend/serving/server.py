"""`spanq serve`: vLLM's OpenAI-compatible server with the span plugin, plus `POST /v1/query/execute`.

The stock routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/metrics`) are vLLM's own. The
span plugin loads through its entry point in the engine core process, so the hooks work there as they do in
the embedded engine. The added route reads a span query in spnl JSON, runs all of it with the executor on
`EngineClientBackend` (span-aware generation, `SpanGenerator`, on the server's `AsyncLLM` engine client) and
answers with the closed tree and usage, or streams the answer as `chat.completion.chunk` events
(`?stream=true`), which is what `SpanBackend` reads.

    spanq serve [--model default|tiny|PATH] [--host 127.0.0.1] [--port 8000] [other `vllm serve` options]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from fastapi import Depends, Request  # module level: FastAPI resolves the route's annotations here

from spanq_backend.serving.generator import (
    ISOLATE_MIN_TOKENS,
    LEAD_IN_NEUTRAL,
    SpanGenerator,
    engine_error,
    load_chat_tokenizer,
)
from spanq_backend.serving.lowering import DEFAULT_ANCHOR
from spanq_backend.serving.processes import ExitGuard
from spanq_backend.serving.recompute import recompute_arg
from spanq_backend.serving.spnl_wire import choices_of, spnl_chunk, spnl_response, wire_format
from spanq_backend.vllm_integration.support import SpanSupport, aquery_span_support
from spanq_integrations.backends.protocol import Backend, BackendCapabilities, Completion, TokenCallback
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
from spanq_integrations.query.ir import (
    ANCHOR_POLICIES,
    COLD_SPAN_POLICIES,
    AnchorPolicy,
    Chat,
    Generate,
    Map,
    Node,
    Recompute,
    walk,
)
from spanq_integrations.query.limits import (
    DEFAULT_LIMITS,
    QueryLimitError,
    QueryLimits,
    check_json_depth,
    check_limits,
)
from spanq_integrations.query.spnl_json import from_json, to_json
from spanq_integrations.runtime.executor import ExecutionResult, aexecute

__all__ = ["EXECUTE_PATH", "SPANS_PATH", "EngineClientBackend", "build_query_router", "parse_serve_args", "serve_main"]

log = logging.getLogger("spanq.server")

SPANS_PATH = "/v1/spans"  # GET: the digests of the spans whose KV the engine holds


# `spanq serve` defaults; every one can be overridden on the command line.
SERVE_DEFAULTS: dict[str, Any] = {
    "model": "default",
    "host": "127.0.0.1",
    "port": 8000,
    "block_size": 32,
    "enable_prefix_caching": True,  # span KV reuse lives in the prefix cache
    "max_model_len": 4096,
    "enable_prompt_tokens_details": True,  # stock routes report cached tokens too
}

CPU_SERVE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "kv_cache_memory_bytes": 1 << 30,  # vLLM's CPU default claims most of the machine's memory
    "enforce_eager": True,  # no torch.compile warm-up: starts in seconds on CPU
}
DEFAULT_MAX_TOKENS = 256  # for a `g` with max_tokens 0 (the server's default)


# --------------------------------------------------------------------------------------------- the backend


class EngineClientBackend(Backend):
    """Span-aware generation on vLLM's `AsyncLLM` engine client (the engine core runs in another process).

    One per server, shared by every query the route runs.
    """

    def __init__(
        self,
        engine_client: Any,
        tokenizer: Any,
        *,
        served_model_names: Sequence[str],
        block_size: int,
        max_model_len: int | None,
        max_concurrency: int = 16,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        span_probe: Any = None,
        span_support: SpanSupport | None = None,
        default_anchor: AnchorPolicy = DEFAULT_ANCHOR,
        default_recompute: Recompute = 0.0,
        default_lead_in: str = LEAD_IN_NEUTRAL,
        cold_spans: str = "auto",
        isolate_min_tokens: int = ISOLATE_MIN_TOKENS,
    ):
        """`span_probe`: the engine's prefix cache as this process sees it (`cache_probe.KVEventsMirror`); a span
        whose prepare prompt it holds wholly is not prepared again. `span_support`: what the engine's
        workers said at start-up (`vllm_integration.support`); without spans, prompts go out as stock."""
        support = span_support or SpanSupport(True)
        self.engine_client = engine_client
        self.served_model_names = tuple(served_model_names)
        self.generator = SpanGenerator(
            self._stream,
            tokenizer,
            block_size=block_size,
            max_model_len=max_model_len,
            model_name=self.served_model_names[0],
            default_max_tokens=default_max_tokens,
            span_probe=span_probe if support.enabled else None,
            spans=support.enabled,
            fallback=None if support.enabled else support.reason,
            default_anchor=default_anchor,
            default_recompute=default_recompute,
            default_lead_in=default_lead_in,
            cold_spans=cold_spans,
            isolate_min_tokens=isolate_min_tokens,
        )
        self.capabilities = BackendCapabilities(
            name="spanq-serve",
            span_aware=True,
            prepares_spans=True,
            span_outputs=True,
            max_concurrency=max_concurrency,
        )

    def check_model(self, model: str, path: str = "$") -> None:
        """Raise `ModelNotFoundError` unless `model` is empty (the default) or a name this server serves."""
        if model and model not in self.served_model_names:
            served = ", ".join(self.served_model_names)
            raise ModelNotFoundError(
                f"{path}: model {model!r} is not served here; this server serves {served} "
                "(or leave the model empty for the default)"
            )

    def check_models(self, query: Node) -> None:
        """Check every call in `query` before anything runs."""
        for path, node in walk(query):
            if isinstance(node, (Generate, Chat, Map)):
                self.check_model(node.model, path)

    async def generate(
        self,
        call: Generate,
        *,
        path: str = "$",
        on_token: TokenCallback | None = None,
        span_output: bool = False,
    ) -> Completion:
        self.check_model(call.model, path)
        return await self.generator.generate(call, path=path, on_token=on_token, span_output=span_output)

    async def _stream(self, prompt_ids: list[int], params: Any) -> AsyncIterator[Any]:
        """One token request on the engine client; aborted if the stream is closed early."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        request_id = f"spanq-{uuid.uuid4().hex}"
        try:
            outputs = self.engine_client.generate(
                TokensPrompt(prompt_token_ids=prompt_ids), params, request_id
            )
            # Closing the stream early (or cancelling its reader) aborts the request and frees its blocks.
            async with aclosing(outputs):
                async for out in outputs:
                    yield out
        except EngineDeadError as e:
            raise BackendUnavailableError(f"the server's engine has stopped: {e}") from e
        except (VLLMClientError, ValueError) as e:
            raise engine_error(e) from e


# --------------------------------------------------------------------------------------------- the route


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


def body_too_large(limits: QueryLimits, size: int | None = None) -> QueryLimitError:
    what = f"{size} bytes" if size is not None else "larger than that"
    return QueryLimitError(
        "$", f"the body is {what}, over the server's limit max_body_bytes={limits.max_body_bytes} "
        "(spanq serve --max-body-bytes)"
    )


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
            "$", f"the request body is not JSON ({e}); send a span query in spnl JSON"
        ) from e
    check_json_depth(doc, limits)
    query = from_json(doc)
    check_limits(query, limits)
    return query


_END = object()


class QueryRun:
    """One query running in the background for a streaming answer: its tokens on a queue, then its result."""

    def __init__(self, backend: EngineClientBackend, query: Node, model: str, wire: str = "spanq"):
        self.backend = backend
        self.model = model
        self.wire = wire  # "spanq": chat.completion.chunk events; "spnl": text_completion chunks (spnl_wire)
        self.id = f"{'cmpl' if wire == 'spnl' else 'chatcmpl'}-spanq-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.pieces: asyncio.Queue[Any] = asyncio.Queue()
        self.streamed = False
        self.task = asyncio.ensure_future(
            aexecute(query, backend, optimize=True, on_token=self.pieces.put_nowait)
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

    def _delta(self, piece: str) -> str:
        self.streamed = True
        if self.wire == "spnl":
            return spnl_chunk(self.id, self.created, self.model, [(0, piece, None)])
        return self._chunk([{"index": 0, "delta": {"content": piece}, "finish_reason": None}])

    def _final(self, result: ExecutionResult) -> str:
        call = result.answer_call
        if self.wire == "spnl":  # every choice whole, except the text of choice 0 already streamed
            choices = choices_of(result)
            rest = [(k, "" if k == 0 and self.streamed else text, reason) for k, (text, reason) in enumerate(choices)]
            return spnl_chunk(self.id, self.created, self.model, rest, usage=usage_of(result))
        if call is None:  # the answer is not one call's output (a top-level plus, say): send it whole
            delta = {"content": result.answer} if result.answer and not self.streamed else {}
            choices = [{"index": 0, "delta": delta, "finish_reason": "stop"}]
        else:  # choice 0 streamed already; the other choices (n > 1) come whole
            choices = [
                {"index": k, "delta": {"content": text} if k and text else {}, "finish_reason": reason}
                for k, (text, reason) in enumerate(zip(call.choices, call.finish_reasons))
            ]
        return self._chunk(choices, usage=usage_of(result))

    async def events(self) -> AsyncIterator[str]:
        try:
            item = self.first
            while item is not _END:
                yield self._delta(item)
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
    default_recompute: Recompute = 0.0,
    default_lead_in: str = LEAD_IN_NEUTRAL,
    cold_spans: str = "auto",
    isolate_min_tokens: int = ISOLATE_MIN_TOKENS,
) -> Any:
    """The FastAPI router of `POST /v1/query/execute`, for an app whose state holds vLLM's engine client."""
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse, StreamingResponse
    from vllm.entrypoints.serve.utils.api_utils import with_cancellation

    router = APIRouter()
    started = asyncio.Lock()

    async def backend_of(request: Request) -> EngineClientBackend:
        state = request.app.state
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
            backend = state.spanq_backend = EngineClientBackend(
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
            )
        return backend

    async def refresh_engine_counters(backend: EngineClientBackend) -> None:
        """Read the engine processes' span counters for /metrics (after each query; never fails a query)."""
        from spanq_backend.serving import metrics
        from spanq_backend.vllm_integration.support import WORKER_STATS_METHOD

        try:
            metrics.set_engine_stats(list(await backend.engine_client.collective_rpc(WORKER_STATS_METHOD)))
        except Exception as e:  # noqa: BLE001  (counters are best effort; the answer is what matters)
            log.debug("could not read the engine's span counters: %s", e)

    async def read_body(request: Request) -> bytes | None:
        """The body, read before the handler runs (`with_cancellation` then listens on the connection for a
        disconnect); None as soon as it is over `max_body_bytes` — declared or received — so an oversized body
        is never held in memory."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limits.max_body_bytes:
            return None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

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
        spans it prepared, most recently used last. What a cluster's span-affinity router routes on."""
        backend = await backend_of(raw_request)
        return JSONResponse(
            {"spans": backend.generator.cached_span_digests(), "probe": backend.generator.span_probe is not None}
        )

    @router.post(EXECUTE_PATH)
    @with_cancellation
    async def execute_query(
        raw_request: Request,
        stream: bool = False,
        format: str | None = None,  # the query parameter `?format=`
        body: bytes | None = Depends(read_body),
    ) -> Any:
        """Run a span query (spnl JSON); `?stream=true` streams the answer. `?format=spanq` (spanq's client):
        the closed tree and per-call metrics, or chat.completion.chunk events; `?format=spnl`, or a text/plain
        body without a format (spnl's client): OpenAI completion objects, or text_completion chunks."""
        backend = await backend_of(raw_request)
        if body is None:
            return error_response(body_too_large(limits))
        try:
            wire = wire_format(format, raw_request.headers.get("content-type"))
            query = parse_query(body, limits)
            backend.check_models(query)
        except SpanQueryError as e:
            return error_response(e)
        if not stream and wire == "spnl":
            try:
                result = await aexecute(query, backend, optimize=True)
            except Exception as e:  # noqa: BLE001 - every failure becomes an error answer
                return error_response(e)
            finally:
                await refresh_engine_counters(backend)
            return JSONResponse(
                spnl_response(
                    query,
                    result,
                    request_id=f"{'cmpl' if isinstance(query, Map) else 'chatcmpl'}-spanq-{uuid.uuid4().hex}",
                    created=int(time.time()),
                    model=served_model_names[0],
                )
            )
        if not stream:
            try:
                result = await aexecute(query, backend, optimize=True)
            except Exception as e:  # noqa: BLE001 - every failure becomes an error answer
                return error_response(e)
            finally:
                await refresh_engine_counters(backend)
            return JSONResponse(
                {
                    "result": to_json(result.tree),
                    "answer": result.answer,
                    "usage": usage_of(result),
                    "calls": [c.model_dump() for c in result.calls],
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


# --------------------------------------------------------------------------------------------- the command


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


ROUTINGS = ("affinity", "default")  # --routing: span affinity (spanq's router) or Ray Serve's own


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_cluster_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`spanq serve`'s cluster options (with `--replicas`, the cluster extra serves N engines on Ray Serve:
    `spanq_backend.cluster`). Defined once: the single-engine command shows them in its help and refuses them
    without `--replicas`; the cluster parses them."""
    group = parser.add_argument_group(
        "several replicas (the cluster extra: pip install 'spanq[cluster]')",
        "with --replicas N, N span engines serve behind one address on Ray Serve, each query routed to the replica "
        "that holds most of its spans",
    )
    group.add_argument("--replicas", type=_positive_int, default=None, metavar="N",
                       help="serve N span engines behind one address (default: one engine, no Ray)")
    group.add_argument("--routing", choices=ROUTINGS, default="affinity",
                       help="with --replicas: route by span affinity (default) or with Ray Serve's own router")
    group.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="with --replicas: an existing Ray cluster (ray://host:10001, host:port or auto); "
                       "default: a local Ray on this machine")
    group.add_argument("--max-imbalance", type=_non_negative_int, default=4, metavar="N",
                       help="with --replicas: a replica holding a query's spans is preferred unless its queue is more "
                       "than N requests longer than the shortest (default 4)")
    return parser


CLUSTER_ONLY = ("--routing", "--ray-address", "--max-imbalance")


def limits_of(args: argparse.Namespace) -> QueryLimits:
    """The query limits `spanq serve` was started with."""
    return QueryLimits(**{name: getattr(args, f"spanq_{name}") for name in DEFAULT_LIMITS.describe()})


def parse_serve_args(argv: Sequence[str]) -> argparse.Namespace:
    """`vllm serve`'s arguments with spanq's defaults; `--model default|tiny|PATH` resolved to a folder."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from spanq_backend.serving.models import resolve_model, served_names

    parser = make_arg_parser(
        FlexibleArgumentParser(
            prog="spanq serve",
            description="vLLM's OpenAI-compatible server with span-aware KV reuse and POST /v1/query/execute. "
            "--model takes default (SmolLM2-135M-Instruct), tiny, or a model folder; every other "
            "`vllm serve` option passes through.",
        )
    )
    limits = parser.add_argument_group(
        "spanq query limits", "what one POST /v1/query/execute may ask for; a query over a limit is a 400 naming it"
    )
    for name, default in DEFAULT_LIMITS.describe().items():
        limits.add_argument(f"--{name.replace('_', '-')}", dest=f"spanq_{name}", type=_positive_int, default=default,
                            metavar="N", help=f"(default {default})")
    parser.add_argument(
        "--span-anchor", dest="spanq_span_anchor", choices=ANCHOR_POLICIES, default=DEFAULT_ANCHOR,
        help="what a document's KV is computed after when its plus names no anchor: template (reused after any "
        "prefix, the default), system (after the query's system prompt), prefix (exact, after the same prefix)",
    )
    parser.add_argument(
        "--span-lead-in", dest="spanq_span_lead_in", default=LEAD_IN_NEUTRAL, metavar="neutral|auto|none|TEXT",
        help="what a template or system anchor reads before each document, as if other documents came first: "
        "neutral (the default: four short passages of plain prose, the same on every server), auto (the start of "
        "the first document the server reads, kept: closer to full attention, but answers then depend on which "
        "document came first, so replicas differ), none, or a text",
    )
    parser.add_argument(
        "--cold-spans", dest="spanq_cold_spans", choices=COLD_SPAN_POLICIES, default="auto",
        help="documents not cached yet: as their size says (auto, the default: isolate from --isolate-min-tokens "
        f"cold tokens, {ISOLATE_MIN_TOKENS} by default, else context); prepared alone first, so the first answer "
        "is the one every later query gets (isolate: faster than stock on large cold prompts, slower on small "
        "ones); computed in context by the query as stock vLLM would, and prepared alone when the engine is idle "
        "(context: a stock answer first, at stock's speed, span answers after)",
    )
    parser.add_argument(
        "--isolate-min-tokens", dest="spanq_isolate_min_tokens", type=_positive_int, default=ISOLATE_MIN_TOKENS,
        metavar="N", help="--cold-spans auto: cold document tokens from which they are prepared alone first",
    )
    parser.add_argument(
        "--recompute", dest="spanq_recompute", type=recompute_arg, default=0.0, metavar="SETTING",
        help="span blocks recomputed in context for quality when a query says nothing: none (the default), first, "
        "last (each span's first / last block), or a share of span blocks such as 0.1",
    )
    parser.add_argument(
        "--verbose", dest="spanq_verbose", action="store_true",
        help="show vLLM's INFO log lines (by default its warnings and errors only; or set SPANQ_LOG_LEVEL)",
    )  # fmt: skip
    add_cluster_arguments(parser)  # shown in --help; they take effect only with --replicas (the cluster)
    parser.set_defaults(**SERVE_DEFAULTS, **(CPU_SERVE_DEFAULTS if current_platform.is_cpu() else {}))
    args = parser.parse_args(list(argv))
    given = [flag for flag in CLUSTER_ONLY if any(a == flag or a.startswith(f"{flag}=") for a in argv)]
    if given and args.replicas is None:
        raise ValueError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --replicas N (several engines)")
    if args.replicas is not None:
        raise ValueError("--replicas needs the cluster extra: pip install 'spanq[cluster]'")
    if args.headless or args.grpc or (args.api_server_count or 1) != 1:
        raise ValueError(
            "spanq serve runs one HTTP API server: --headless, --grpc and --api-server-count are not supported"
        )
    spec = args.model_tag or args.model
    path = resolve_model(spec)
    from spanq_backend.serving.families import check_loadable, check_spans
    from spanq_backend.vllm_integration.kv_layout import has_sliding_window_layers

    check_loadable(path)  # an architecture vLLM does not run: refused here, in one line
    check_spans(path)  # a RelocationError (a ValueError) refuses the model before vLLM starts
    if has_sliding_window_layers(path) and args.disable_hybrid_kv_cache_manager is None:
        args.disable_hybrid_kv_cache_manager = True  # one KV cache group: the one spans are moved in
    args.model, args.model_tag = str(path), None
    if not args.served_model_name:
        # Answer to the name the server was started with (`tiny`, a folder, a hub id) as well as the folder's:
        # /v1/models lists them all, the query route and the OpenAI routes accept any (or none).
        args.served_model_name = served_names(spec, path)
    if args.kv_events_config is None:
        # vLLM's KV cache events on a private socket: the query route follows the prefix cache through them
        # and skips prepare requests for spans already cached (`cache_probe.KVEventsMirror`).
        import tempfile
        import uuid

        from vllm.config.kv_events import KVEventsConfig

        socket_path = f"{tempfile.gettempdir()}/spanq-kv-{uuid.uuid4().hex[:12]}"
        if len(socket_path) > 100:  # a Unix socket path holds at most ~107 bytes
            socket_path = f"/tmp/spanq-kv-{uuid.uuid4().hex[:12]}"
        args.kv_events_config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", topic="spanq-kv", endpoint=f"ipc://{socket_path}"
        )
    return args


GRACEFUL_HTTP_S = 5  # once the engine has stopped, how long the HTTP server waits for open connections
EXIT_DEADLINE_S = 30.0  # after a SIGTERM, the most `spanq serve` takes to exit (plus any --shutdown-timeout)


async def _run_server(args: argparse.Namespace, guard: ExitGuard) -> None:
    """vLLM's `run_server`, less the SIGTERM handler it sets for the engine's startup, and with a bound on the
    HTTP server's graceful shutdown.

    A SIGTERM (also the one a supervisor's death sends, `spanq_backend.cluster.supervise`) ends the server and
    its engine core within a bound (`ExitGuard`): before the HTTP server is up, at once; after, through vLLM's
    graceful shutdown (the engine core is stopped, then the HTTP server, which leaves open connections
    `GRACEFUL_HTTP_S`), or killed `EXIT_DEADLINE_S` after the signal. (vLLM's handler for the startup raises
    KeyboardInterrupt, which its engine launch swallows: a server stopped while its engine core started would
    wait minutes for an engine core that waits for it, or go on serving.)"""
    from vllm.entrypoints.launchers.api_server import entry

    follow = asyncio.ensure_future(guard.follow_graceful())
    try:
        entry.decorate_logs("APIServer", skip_if_decorated=True)
        listen_address, sock = entry.setup_server(args, reuse_port=False)
        await entry.run_server_worker(listen_address, sock, args, timeout_graceful_shutdown=GRACEFUL_HTTP_S)
    finally:
        follow.cancel()


def serve_main(argv: list[str]) -> int:
    """`spanq serve ...`: run the server until interrupted."""
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    guard = ExitGuard(EXIT_DEADLINE_S)  # a SIGTERM from here on ends this process and its engine core
    guard.install()
    cli_env_setup()
    try:
        args = parse_serve_args(argv)
        from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

        validate_parsed_serve_args(args)
        from spanq_backend.serving.logs import level

        level()  # an unknown SPANQ_LOG_LEVEL is an error before anything starts
        tokenizer = load_chat_tokenizer(args.tokenizer or args.model)
    except (ValueError, SpanQueryError) as e:
        print(f"spanq serve: error: {e}", file=sys.stderr)
        return 2

    import uvloop
    from vllm.logger import configure_logging_from_args

    configure_logging_from_args(args)
    from spanq_backend.serving import logs

    logs.configure(verbose=args.spanq_verbose)
    from spanq_backend.serving.families import family_line

    log.info("%s", family_line(args.model))
    from spanq_backend.serving import metrics

    metrics.register()  # spanq's counters on /metrics from the first scrape
    from spanq_backend.vllm_integration.frontend import query_route_mounted

    limits = limits_of(args)
    anchor, redo = args.spanq_span_anchor, args.spanq_recompute
    lead_in = args.spanq_span_lead_in
    with query_route_mounted(
        lambda: build_query_router(
            tokenizer, args.served_model_name, limits, anchor, redo, lead_in,
            args.spanq_cold_spans, args.spanq_isolate_min_tokens,
        )
    ):
        guard.deadline_s += args.shutdown_timeout  # vLLM's drain (--shutdown-timeout) comes first
        uvloop.run(_run_server(args, guard))
    return 0


if __name__ == "__main__":
    raise SystemExit(serve_main(sys.argv[1:]))
