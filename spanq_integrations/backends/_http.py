"""What the HTTP backends share: streaming a chat-completion SSE response, and mapping HTTP errors to spanq's.

`OpenAIBackend` (any OpenAI-compatible server) and `SpanBackend` (a `spanq serve` server) both receive
`chat.completion.chunk` events over Server-Sent Events and both map failures to the typed errors of
`spanq_integrations.query.errors`; this module is the one place that does either.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from spanq_integrations.backends.protocol import Backend, TokenCallback
from spanq_integrations.query.errors import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    ContextLengthError,
    ModelNotFoundError,
    OptimizerError,
    QueryParseError,
    QueryValidationError,
    ReducerParseError,
    SpanQueryError,
)

DEFAULT_TIMEOUT_S = 600.0  # seconds a URL backend waits for an answer, unless told otherwise (every front door)
DEFAULT_MAX_RETRIES = 2  # retries of a connection that failed

__all__ = [
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT_S",
    "ChunkStream",
    "HTTPBackend",
    "StreamResult",
    "error_from_payload",
    "iter_sse_data",
    "normalize_base_url",
]

# Messages that servers use for "the prompt does not fit the context window" (vLLM, OpenAI, llama.cpp).
CONTEXT_LENGTH_MARKERS = (
    "maximum context length",
    "longer than the maximum",
    "context_length_exceeded",
    "exceeds the available context size",
)


# Paths of an OpenAI-compatible server's (or spanq serve's) endpoints: a backend URL ending so named one, not a root
ENDPOINT_PATHS = ("/chat/completions", "/completions", "/v1/models", "/v1/query/execute")


def normalize_base_url(url: str) -> str:
    """The server's root URL: no trailing slash and no trailing `/v1` (both spellings are accepted); the scheme in
    lower case (schemes are case-insensitive). A URL that cannot name a server (no host, a port out of range or
    not a number, a broken IPv6 address, an endpoint's path) is a `BackendError` naming it."""
    url = url.strip()
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() in ("http", "https"):
        url = f"{scheme.lower()}://{rest}"
    if not url.startswith(("http://", "https://")):
        raise BackendError(f"backend URL {url!r} must start with http:// or https://")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # (raises for a port out of range or not a number)  # noqa: B018
    except ValueError as e:  # (raised from inside the HTTP client, or as an error group from its connect)
        raise BackendError(f"backend URL {url!r} is not a server's address: {e}") from None
    if not parts.hostname:  # ("http://": it said the URL did not start with http://)
        raise BackendError(f"backend URL {url!r} names no host: give one, as in http://localhost:8000")
    path = parts.path.rstrip("/")
    if path.endswith(ENDPOINT_PATHS):  # (it asked "…/v1/chat/completions/v1/models" and named a 404)
        root = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "", "", ""))
        raise BackendError(f"backend URL {url!r} names an endpoint ({path}): give the server's root URL, as in {root}")
    return url.rstrip("/").removesuffix("/v1")


# --------------------------------------------------------------------------------------------- SSE


async def iter_sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The `data` payload of each Server-Sent Event in `lines` (multi-line data joined by newlines).

    Comments (`: ...`) and other fields (`event:`, `id:`, `retry:`) are skipped; an event ends at a blank line.
    A trailing event without its blank line is still yielded.
    """
    data: list[str] = []
    async for line in lines:
        line = line.rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value.removeprefix(" "))
    if data:
        yield "\n".join(data)


@dataclass
class StreamResult:
    """What one streamed call produced, as the client measured it."""

    texts: list[str]
    finish_reasons: list[str | None]
    usage: dict[str, Any]
    ttft_s: float | None
    wall_s: float
    chunks: int
    model: str = ""


@dataclass
class ChunkStream:
    """Accumulates `chat.completion.chunk` events: the text of each choice, finish reasons, usage and TTFT.

    `started` is the `time.perf_counter()` at which the request was sent; TTFT is the time from then to the
    first non-empty content delta of any choice.
    """

    started: float
    n: int = 1
    on_token: TokenCallback | None = None
    texts: dict[int, list[str]] = field(default_factory=dict)
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    usage: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    chunks: int = 0
    done: bool = False  # `data: [DONE]` seen
    first_content_at: float | None = None

    async def feed(self, payload: str, *, where: str) -> None:
        """Take one SSE data payload; raise the mapped error if the server sent an error event."""
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(payload)
        except ValueError as e:
            raise BackendError(f"{where} sent a stream event that is not JSON: {payload[:200]!r}") from e
        if not isinstance(chunk, dict):
            raise BackendError(f"{where} sent a stream event that is not a JSON object: {payload[:200]!r}")
        self.chunks += 1
        if "error" in chunk:  # vLLM reports failures after the headers as an error event
            raise error_from_payload(chunk, status=None, where=where)
        self.model = chunk.get("model") or self.model
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            index = int(choice.get("index", 0))
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece:
                if self.first_content_at is None:
                    self.first_content_at = time.perf_counter()
                self.texts.setdefault(index, []).append(piece)
                if index == 0 and self.on_token is not None:
                    maybe = self.on_token(piece)
                    if inspect.isawaitable(maybe):
                        await maybe
            if choice.get("finish_reason") is not None:
                self.finish_reasons[index] = choice["finish_reason"]

    @property
    def complete(self) -> bool:
        """Whether the stream ended properly: `[DONE]`, or a finish reason for every choice."""
        return self.done or all(i in self.finish_reasons for i in range(self.n))

    def result(self) -> StreamResult:
        count = max([self.n, *(i + 1 for i in self.texts), *(i + 1 for i in self.finish_reasons)])
        return StreamResult(
            texts=["".join(self.texts.get(i, ())) for i in range(count)],
            finish_reasons=[self.finish_reasons.get(i) for i in range(count)],
            usage=self.usage,
            ttft_s=None if self.first_content_at is None else self.first_content_at - self.started,
            wall_s=time.perf_counter() - self.started,
            chunks=self.chunks,
            model=self.model,
        )


# --------------------------------------------------------------------------------------------- errors

# Error type names a `spanq serve` server sends in `{"error": {"type": ...}}`, and the classes they become.
_PATH_ERRORS: dict[str, type[QueryParseError | QueryValidationError]] = {
    "QueryParseError": QueryParseError,
    "QueryValidationError": QueryValidationError,
}
_MESSAGE_ERRORS: dict[str, type[SpanQueryError]] = {
    "SpanQueryError": SpanQueryError,
    "OptimizerError": OptimizerError,
    "ReducerParseError": ReducerParseError,
    "BackendError": BackendError,
    "GenerationError": BackendError,  # its cause stayed on the server; the executor adds the client-side path
    "BackendUnavailableError": BackendUnavailableError,
    "ModelNotFoundError": ModelNotFoundError,
    "ContextLengthError": ContextLengthError,
}


def _split_path(message: str) -> tuple[str, str]:
    """`"$.g.input: bad"` → `("$.g.input", "bad")`; a message without a leading path gets path `$`."""
    head, sep, rest = message.partition(": ")
    if sep and head.startswith("$") and " " not in head:
        return head, rest
    return "$", message


def _error_fields(body: Any) -> tuple[str, str, Any]:
    """(message, type, code) of an error body in the OpenAI shape, or of any other JSON/text body."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            message = err.get("message") or err.get("detail") or json.dumps(err)
            return str(message), str(err.get("type") or ""), err.get("code")
        if isinstance(err, str):  # Ollama's native shape: {"error": "..."}
            return err, "", None
        if "detail" in body:  # FastAPI's default shape
            return str(body["detail"]), "", None
    return (body if isinstance(body, str) else json.dumps(body)).strip(), "", None


def is_model_not_found(status: int | None, message: str, error_type: str = "", code: Any = None) -> bool:
    if error_type == "ModelNotFoundError" or code == "model_not_found":
        return True
    text = message.lower()
    return status == 404 and "model" in text and ("does not exist" in text or "not found" in text)


def context_length_hint(message: str) -> str:
    """What to do about a context-length refusal: lower `max_tokens` where the message blames it (a prompt
    split in parts would not help), else shorten or split the prompt — in Python and on the command line."""
    if _split_path(message)[0].endswith(".max_tokens") or "is not below the model's context window" in message:
        return "lower max_tokens"
    return ("shorten the prompt, lower max_tokens, or split the input (tree reduction: tree_reduction=k in Python, "
            "spanq run --tree-k K, or a judge's k)")


def error_from_payload(body: Any, *, status: int | None, where: str, key_sent: bool = False) -> SpanQueryError:
    """The typed error for an error answer (`body`: parsed JSON or text; `status`: None inside a stream;
    `key_sent`: the call carried an API key, so a 401 refused that key rather than asked for one)."""
    message, error_type, code = _error_fields(body)
    if status is None and isinstance(code, int):
        status = code
    if error_type in _PATH_ERRORS:
        path, rest = _split_path(message)
        return _PATH_ERRORS[error_type](path, rest)
    if is_model_not_found(status, message, error_type, code):
        return ModelNotFoundError(f"{where}: {message}")
    if error_type == "ContextLengthError" or any(m in message.lower() for m in CONTEXT_LENGTH_MARKERS):
        return ContextLengthError(f"{where}: {message} — {context_length_hint(message)}")
    if error_type in _MESSAGE_ERRORS:
        return _MESSAGE_ERRORS[error_type](f"{where}: {message}")
    if status in (502, 503, 504):
        return BackendUnavailableError(f"{where} is unavailable (HTTP {status}): {message}")
    if status == 429:
        return BackendUnavailableError(f"{where} is limiting its rate (HTTP 429), still after the retries "
                                       f"(max_retries): {message}")
    if status in (401, 403):
        wants = ("it refused the API key sent (api_key=, or $SPANQ_API_KEY where none was passed)" if key_sent else
                 "it wants an API key; pass api_key= (execute, judge, the adapters, a backend) or set SPANQ_API_KEY")
        return BackendError(f"{where} refused the call (HTTP {status}: {message}): {wants}")
    label = f"HTTP {status}" if status is not None else "an error in the stream"
    return BackendError(f"{where} answered {label}: {message}")


def _parse_body(raw: bytes) -> Any:
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def _unreachable(url: str, e: Exception) -> BackendUnavailableError:
    reason = str(e) or type(e).__name__
    return BackendUnavailableError(f"cannot reach {url}: {reason} — is the server running?")


ERROR_BODY_BYTES = 64 << 10  # of an error answer, read for its message (a 300 MB error page is not held whole)
MAX_RETRY_AFTER_S = 30.0  # the longest a Retry-After is waited for before a retry


def _retry_after(value: str | None, default: float) -> float:
    """Seconds a Retry-After header asks for (seconds, or an HTTP date), within [0, MAX_RETRY_AFTER_S]."""
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return default
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


async def _read_body(response: httpx.Response, limit: int | None) -> bytes:
    """The answer's body, at most `limit` bytes of it (None: all)."""
    if limit is None:
        return await response.aread()
    parts, size = [], 0
    async for chunk in response.aiter_bytes():
        parts.append(chunk[: limit - size])
        size += len(parts[-1])
        if size >= limit:
            break
    return b"".join(parts)


@contextlib.asynccontextmanager
async def _deadline(seconds: float | None, url: str) -> AsyncIterator[None]:
    """A whole call's time limit (httpx's timeout is per read: a server sending a byte now and then, or a
    token every half second, never tripped it)."""
    if not seconds:
        yield
        return
    limit = asyncio.timeout(seconds)
    try:
        async with limit:
            yield
    except TimeoutError as e:
        if not limit.expired():  # (the call's own timeout error, a read's: said as it is)
            raise
        raise BackendTimeoutError(
            f"{url} did not finish the call within {seconds:g} s (the backend's timeout, for a whole call): the "
            "server may be overloaded, or the answer long; raise the backend's timeout"
        ) from e


# Connection failures before any byte came back: safe to retry, the server never saw (or never answered) it.
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError)


# --------------------------------------------------------------------------------------------- base class


def _json_body(response: httpx.Response, url: str) -> Any:
    try:
        return response.json()
    except ValueError as e:
        raise BackendError(f"{url} answered with something that is not JSON: {response.text[:200]!r}") from e


class HTTPBackend(Backend):
    """A backend that talks to a server over HTTP with one pooled `httpx.AsyncClient`."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        headers: dict[str, str] | None = None,
        max_concurrency: int = 8,
        api_key: str | None = None,
    ):
        headers = dict(headers or {})
        if api_key:
            headers.setdefault("Authorization", f"Bearer {api_key}")
        self._key_sent = any(name.lower() == "authorization" for name in headers)
        self.base_url = normalize_base_url(base_url)
        self.max_retries = max(0, max_retries)
        self.timeout = timeout  # a whole call's limit (sending, waiting, reading every chunk)
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            # per read too (a stalled server); waiting for a pooled connection is not the server's time
            timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0), pool=None),
            headers=headers or {},
            # the executor bounds how many calls run at once (it may allow more than this backend's default)
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=max(max_concurrency, 1) + 2),
        )
        self._served_models: list[str] | None = None

    async def aclose(self) -> None:
        await self._client.aclose()

    # ----------------------------------------------------------------------------------------- requests

    async def _with_retries(self, send: Callable[[], Awaitable[Any]], url: str) -> Any:
        """Run `send()`, retrying connection failures that happened before any byte came back, and answers that
        say "later" (429, 503: nothing was generated), after their Retry-After (at most `MAX_RETRY_AFTER_S`)."""
        attempt = 0
        while True:
            try:
                response = await send()
                if (
                    isinstance(response, httpx.Response)
                    and response.status_code in (429, 503)
                    and attempt < self.max_retries
                ):
                    wait = _retry_after(response.headers.get("retry-after"), 0.25 * 2**attempt)
                    await response.aclose()
                    await asyncio.sleep(wait)
                    attempt += 1
                    continue
                return response
            except _RETRYABLE as e:
                if attempt >= self.max_retries:
                    raise _unreachable(url, e) from e
            except httpx.TimeoutException as e:  # connected, but no answer in time
                raise BackendTimeoutError(
                    f"{url} did not answer in time ({type(e).__name__}): the server may be overloaded; "
                    "raise the backend's timeout"
                ) from e
            except httpx.TransportError as e:
                raise _unreachable(url, e) from e
            await asyncio.sleep(0.25 * 2**attempt)
            attempt += 1

    async def _get_json(self, path: str) -> Any:
        url = f"{self.base_url}{path}"
        response = await self._with_retries(lambda: self._client.get(path), url)
        if response.status_code >= 400:
            raise error_from_payload(_parse_body(response.content), status=response.status_code, where=url,
                                     key_sent=self._key_sent)
        return _json_body(response, url)

    async def _post_json(self, path: str, body: dict[str, Any], *, model: str = "") -> Any:
        """POST and read a JSON answer. Retried only while no answer has begun: a body broken off after its
        head is an error, never the request sent again (the server ran it)."""
        url = f"{self.base_url}{path}"

        async def send() -> httpx.Response:
            return await self._client.send(self._client.build_request("POST", path, json=body), stream=True)

        async with _deadline(self.timeout, url):
            response: httpx.Response = await self._with_retries(send, url)
            try:
                try:
                    raw = await _read_body(response, None if response.status_code < 400 else ERROR_BODY_BYTES)
                except httpx.TransportError as e:
                    raise BackendUnavailableError(
                        f"the answer from {url} broke off after it began ({type(e).__name__}): the server ran the "
                        "request; it was not sent again"
                    ) from e
            finally:
                await response.aclose()
        if response.status_code >= 400:
            raise await self._http_error(response.status_code, raw, url, model)
        try:
            return json.loads(raw)
        except ValueError as e:
            raise BackendError(f"{url} answered with something that is not JSON: {raw[:200]!r}") from e

    async def token_ids(self, text: str, model: str = "") -> list[int] | None:
        """vLLM's `POST /tokenize` (`spanq serve` and vLLM's own server answer it); None where the server has no
        such route or cannot be reached (an error here would fail a count, not a call)."""
        body: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
        name = model or getattr(self, "model", "") or ""
        if name:
            body["model"] = name
        try:
            answer = await self._post_json("/tokenize", body, model=name)
        except SpanQueryError:
            return None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return [int(t) for t in tokens] if isinstance(tokens, list) else None

    async def served_models(self) -> list[str]:
        """The model ids the server lists under GET /v1/models (fetched once, then cached)."""
        if self._served_models is None:
            listing = await self._get_json("/v1/models")
            data = listing.get("data") if isinstance(listing, dict) else None
            self._served_models = [
                str(m.get("id")) for m in data or () if isinstance(m, dict) and m.get("id")
            ]
        return self._served_models

    async def _http_error(self, status: int, raw: bytes, url: str, model: str) -> SpanQueryError:
        error = error_from_payload(_parse_body(raw), status=status, where=url, key_sent=self._key_sent)
        if isinstance(error, ModelNotFoundError):
            try:
                served = ", ".join(await self.served_models()) or "(none)"
            except SpanQueryError as e:
                served = f"(the list could not be read: {e})"
            asked = f"model {model!r}" if model else "the requested model"
            error = ModelNotFoundError(
                f"{url} does not serve {asked}: it serves {served}. Pass one of those as the model."
            )
        return error

    async def _stream_chunks(
        self, path: str, body: dict[str, Any], *, n: int = 1, on_token: TokenCallback | None, model: str = ""
    ) -> StreamResult:
        """POST `body` to `path` and read its SSE `chat.completion.chunk` stream to the end."""
        url = f"{self.base_url}{path}"
        started = time.perf_counter()
        stream = ChunkStream(started=started, n=n, on_token=on_token)

        async def send() -> httpx.Response:
            request = self._client.build_request(
                "POST", path, json=body, headers={"Accept": "text/event-stream"}
            )
            return await self._client.send(request, stream=True)

        async with _deadline(self.timeout, url):
            response: httpx.Response = await self._with_retries(send, url)
            try:
                if response.status_code >= 400:
                    raw = await _read_body(response, ERROR_BODY_BYTES)
                    raise await self._http_error(response.status_code, raw, url, model)
                kind = response.headers.get("content-type", "")
                if not kind.lower().startswith("text/event-stream"):  # an error (or a whole answer) as JSON
                    raw = await _read_body(response, ERROR_BODY_BYTES)
                    payload = _parse_body(raw)
                    if isinstance(payload, dict) and "error" in payload:
                        raise error_from_payload(payload, status=response.status_code, where=url,
                                                 key_sent=self._key_sent)
                    raise BackendError(f"{url} answered HTTP {response.status_code} with {kind or 'no content type'}, "
                                       f"not a stream of events: {raw[:200]!r}")  # fmt: skip
                # (At [DONE] the rest of the body is left unread, and the connection closed with it: a backend is
                # used from more than one event loop — LangChain's sync calls run on a loop of spanq's, its async
                # ones on the caller's — and a kept connection belongs to the loop that opened it.)
                try:
                    async for payload in iter_sse_data(response.aiter_lines()):
                        await stream.feed(payload, where=url)
                        if stream.done:
                            break
                except httpx.TransportError as e:  # dropped connection, incomplete chunked body, read timeout
                    raise BackendUnavailableError(
                        f"the stream from {url} broke after {stream.chunks} chunks: {type(e).__name__}: {e}"
                    ) from e
            finally:
                await response.aclose()
        if not stream.complete:
            raise BackendUnavailableError(
                f"the stream from {url} broke after {stream.chunks} chunks: it ended without [DONE] or a "
                "finish reason (the server may have crashed or dropped the connection)"
            )
        missing = [i for i in range(n) if i not in stream.finish_reasons and i not in stream.texts]
        if n > 1 and missing:
            raise BackendError(
                f"{url} answered {n - len(missing)} of the {n} choices asked for (n={n}): it does not support n; "
                "ask for the choices as separate calls (repeat(n, ...))"
            )
        return stream.result()
