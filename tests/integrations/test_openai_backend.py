"""OpenAIBackend against a real stock vLLM server; the shared SSE/error handling; SpanBackend's wire protocol."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from spanq_integrations import (
    Assistant,
    BackendError,
    BackendUnavailableError,
    ContextLengthError,
    ModelNotFoundError,
    QueryParseError,
    cross,
    execute,
    generate,
    plus,
    resolve_backend,
    system,
    user,
)
from spanq_integrations.backends._http import (
    ChunkStream,
    error_from_payload,
    iter_sse_data,
    normalize_base_url,
)
from spanq_integrations.backends.openai import OpenAIBackend, server_model_name
from spanq_integrations.backends.span import SpanBackend
from tests.conftest import STOCK_API_KEY


def long_prompt(words: int = 700) -> str:
    """A prompt of about 1.3 tokens a word, unique per call so that the first send is never a cache hit."""
    head = f"Session {uuid.uuid4().hex}. Read the notes below and summarise them.\n"
    body = " ".join(
        f"note {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} valve is open." for i in range(words // 7)
    )
    return head + body


# --------------------------------------------------------------------------------------------- a scripted TCP peer


@contextlib.asynccontextmanager
async def raw_http_server(reply: Callable[[bytes, bytes], bytes]) -> AsyncIterator[tuple[str, list]]:
    """A loopback HTTP peer that reads one request, writes `reply(head, body)` verbatim and closes the socket.

    Yields its base URL and the list of (head, body) requests it received.
    """
    received: list[tuple[bytes, bytes]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = await reader.readexactly(length)
            received.append((head, body))
            writer.write(reply(head, body))
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}", received


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def chunk(content: str, finish_reason: str | None = None, index: int = 0) -> dict:
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "tiny",
        "choices": [{"index": index, "delta": {"content": content}, "finish_reason": finish_reason}],
    }


def http_response(status: str, body: bytes, content_type: str, *, chunked: bool = False) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nConnection: close\r\n"
    if chunked:
        return (
            (head + "Transfer-Encoding: chunked\r\n\r\n").encode()
            + f"{len(body):x}\r\n".encode()
            + body
            + b"\r\n"
        )
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


# --------------------------------------------------------------------------------------------- SSE and errors


async def _lines(*lines: str) -> AsyncIterator[str]:
    for line in lines:
        yield line


async def test_sse_parser_joins_multiline_data_and_skips_comments():
    events = [
        e
        async for e in iter_sse_data(
            _lines(": keep-alive", "event: message", 'data: {"a":', "data: 1}", "", "", "data: [DONE]\r", "")
        )
    ]
    assert events == ['{"a":\n1}', "[DONE]"]


async def test_chunk_stream_collects_choices_usage_and_streams_the_first():
    pieces: list[str] = []
    stream = ChunkStream(started=0.0, n=2, on_token=pieces.append)
    for event in (
        chunk("Hel"),
        chunk("lo"),
        chunk("Bye", index=1),
        chunk("", "stop"),
        chunk("", "length", index=1),
    ):
        await stream.feed(json.dumps(event), where="test")
    usage = {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 4},
        "padded_tokens": 2,
        "prepared_spans": 1,
    }
    await stream.feed(json.dumps({"choices": [], "usage": usage}), where="test")
    await stream.feed("[DONE]", where="test")
    result = stream.result()
    assert result.texts == ["Hello", "Bye"]
    assert result.finish_reasons == ["stop", "length"]
    assert result.usage == usage
    assert pieces == ["Hel", "lo"]
    assert stream.complete and result.chunks == 6


async def test_error_event_inside_a_stream_is_typed():
    stream = ChunkStream(started=0.0)
    error = {
        "error": {
            "message": "$.g.input.plus[2]: unknown node 'bogus'",
            "type": "QueryParseError",
            "code": 400,
        }
    }
    with pytest.raises(QueryParseError) as info:
        await stream.feed(json.dumps(error), where="http://x")
    assert info.value.path == "$.g.input.plus[2]"
    assert "unknown node" in info.value.message


@pytest.mark.parametrize(
    "status, body, expected",
    [
        (
            404,
            {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "code": 404}},
            ModelNotFoundError,
        ),
        (
            400,
            {"error": {"message": "This model's maximum context length is 4096 tokens.", "code": 400}},
            ContextLengthError,
        ),
        (
            400,
            {"error": {"message": "prompt is longer than the maximum model length", "code": 400}},
            ContextLengthError,
        ),
        (400, {"error": {"message": "span too long", "type": "ContextLengthError"}}, ContextLengthError),
        (503, "Service Unavailable", BackendUnavailableError),
        (500, {"error": {"message": "boom", "type": "InternalServerError"}}, BackendError),
    ],
)
def test_http_errors_map_to_typed_errors(status, body, expected):
    error = error_from_payload(body, status=status, where="http://x/v1/chat/completions")
    assert type(error) is expected
    assert "http://x/v1/chat/completions" in str(error)


def test_a_context_length_refusal_says_what_to_do_about_its_own_cause():
    """A call refused for its max_tokens (no prompt fits) is told to lower max_tokens — splitting the input, the
    hint for a prompt too long, would not help it; the prompt's hint names the command line's flag too."""
    blamed = {"error": {"message": "$.g.max_tokens: max_tokens=5000 is not below the model's context window of 4096 "
                                   "tokens; this prompt of 9 tokens leaves room for at most 4087",
                        "type": "ContextLengthError"}}  # fmt: skip
    error = error_from_payload(blamed, status=400, where="http://x/v1/query/execute")
    assert str(error).endswith("— lower max_tokens") and "split" not in str(error)
    long = {"error": {"message": "This model's maximum context length is 4096 tokens.", "code": 400}}
    error = error_from_payload(long, status=400, where="http://x/v1/chat/completions")
    assert "split the input" in str(error) and "spanq run --tree-k K" in str(error)


def test_base_url_and_model_names_are_normalised():
    assert normalize_base_url("http://h:1/v1/") == normalize_base_url("http://h:1") == "http://h:1"
    # a URL with no host was cut to "http:" and refused for not starting with http://
    for hostless in ("http://", "https:///v1", "http://:8000"):
        with pytest.raises(BackendError, match=f"backend URL '{re.escape(hostless)}' names no host"):
            normalize_base_url(hostless)
    with pytest.raises(BackendError, match="'ftp://h' must start with http:// or https://"):
        normalize_base_url("ftp://h")
    # A URL no server can have was refused from inside the HTTP client: an error group from its connect ("port
    # must be 0-65535"), httpx's InvalidURL, urllib's ValueError — none of them spanq's errors, none naming the URL
    for bad, why in [("http://127.0.0.1:80123", "Port out of range"), ("http://h:notaport", "Port could not be cast"),
                     ("http://[::1", "Invalid IPv6 URL")]:
        with pytest.raises(BackendError, match=rf"backend URL '{re.escape(bad)}' is not a server's address: {why}"):
            normalize_base_url(bad)
    with pytest.raises(BackendError, match=r"names an endpoint \(/v1/chat/completions\): give the server's root URL, as "
                       r"in http://h:1"):
        normalize_base_url("http://h:1/v1/chat/completions")
    assert normalize_base_url("HTTP://h:1/v1") == "http://h:1", "schemes are case-insensitive"
    for spec in ("HTTP://h:1", "Spanq+Http://h:1"):
        backend, owned = resolve_backend(spec)  # (was "an unknown backend")
        assert owned and backend.base_url == "http://h:1"
        asyncio.run(backend.aclose())
    with pytest.raises(BackendError, match="'http://127.0.0.1:80123' is not a server's address"):
        execute(generate(user("Hi"), max_tokens=1), "spanq+http://127.0.0.1:80123")
    assert server_model_name("vllm/tiny") == "tiny"
    assert server_model_name("ollama/granite3.2:2b") == "granite3.2:2b"
    assert server_model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


# --------------------------------------------------------------------------------------------- failures of the peer


async def test_server_down_is_backend_unavailable():
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with OpenAIBackend(f"http://127.0.0.1:{port}", model="tiny", max_retries=1) as backend:
        with pytest.raises(BackendUnavailableError, match="cannot reach .*is the server running"):
            await backend.generate(generate(user("hi"), max_tokens=4))


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked-body-cut", "eof-without-done"])
async def test_connection_dropped_mid_stream_is_backend_unavailable(chunked):
    reply = http_response("200 OK", sse(chunk("partial")), "text/event-stream", chunked=chunked)
    async with (
        raw_http_server(lambda head, body: reply) as (url, received),
        OpenAIBackend(url, model="tiny", max_retries=0) as backend,
    ):
        with pytest.raises(BackendUnavailableError, match="broke after 1 chunks"):
            await backend.generate(generate(user("hi"), max_tokens=4))
    assert len(received) == 1  # a stream that had started is never retried


async def test_other_http_errors_carry_status_and_message():
    reply = http_response(
        "500 Internal Server Error", b'{"error": {"message": "kaput", "code": 500}}', "application/json"
    )
    async with (
        raw_http_server(lambda head, body: reply) as (url, _),
        OpenAIBackend(url, model="tiny") as backend,
    ):
        with pytest.raises(BackendError, match="HTTP 500: kaput"):
            await backend.generate(generate(user("hi"), max_tokens=4))


@contextlib.asynccontextmanager
async def scripted_server(script: Callable[[int, asyncio.StreamWriter], object]) -> AsyncIterator[tuple[str, list]]:
    """A loopback HTTP peer whose answer to its k-th request (k = 0, 1, ...) is written by `await script(k,
    writer)` — over time if it likes (a trickle, a stall, a body broken off). Yields its URL and the requests."""
    received: list[tuple[bytes, bytes]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
            received.append((head, await reader.readexactly(length)))
            await script(len(received) - 1, writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", received


async def test_the_timeout_bounds_a_whole_call_even_when_the_server_trickles():
    """httpx's timeout is per read: a server that sends a comment every 0.3 s (or a token every 0.3 s) never
    trips it. The backend's timeout is a whole call's."""
    async def trickle(k, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"8\r\n: ping\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.3)

    async with scripted_server(trickle) as (url, _), OpenAIBackend(url, model="tiny", timeout=1.5) as backend:
        started = asyncio.get_running_loop().time()
        with pytest.raises(BackendUnavailableError, match=r"within 1\.5 s") as raised:
            await asyncio.wait_for(backend.generate(generate(user("hi"), max_tokens=4)), timeout=20)
        assert asyncio.get_running_loop().time() - started < 5
    assert isinstance(raised.value, TimeoutError)  # (and spanq's: what retry helpers and asyncio callers catch)


async def test_a_server_that_ignores_n_is_an_error_not_empty_answers():
    reply = http_response("200 OK", sse(chunk("only one", "stop"), "[DONE]"), "text/event-stream")
    async with raw_http_server(lambda head, body: reply) as (url, _), OpenAIBackend(url, model="tiny") as backend:
        with pytest.raises(BackendError, match=r"1 of the 3 choices .*does not support n"):
            await backend.generate(generate(user("hi"), max_tokens=4, n=3, temperature=0.7))


async def test_a_remote_query_whose_answer_broke_off_is_not_sent_again():
    """The server ran the query and began its answer, then the connection went: running it again would run every
    call of it again (and bill them); it is an error saying so."""
    async def broken(k, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"resu")

    async with scripted_server(broken) as (url, received), SpanBackend(url, max_retries=2) as backend:
        with pytest.raises(BackendUnavailableError, match="broke off after it began"):
            await backend.execute_remote(generate(user("hi"), max_tokens=4))
    assert len(received) == 1


async def test_an_answer_that_is_not_a_stream_is_read_for_what_it_says():
    overloaded = http_response("200 OK", b'{"error": {"message": "model is overloaded", "code": 200}}',
                               "application/json")  # fmt: skip
    async with raw_http_server(lambda head, body: overloaded) as (url, _), OpenAIBackend(url, model="tiny") as backend:
        with pytest.raises(BackendError, match="model is overloaded"):
            await backend.generate(generate(user("hi"), max_tokens=4))
    huge = http_response("500 Internal Server Error", b"x" * (4 << 20), "text/plain")
    async with raw_http_server(lambda head, body: huge) as (url, _), OpenAIBackend(url, model="tiny") as backend:
        with pytest.raises(BackendError, match="HTTP 500") as info:
            await backend.generate(generate(user("hi"), max_tokens=4))
    assert len(str(info.value)) < 100_000, "a huge error page is not pasted whole into the message"


async def test_a_429_is_retried_after_its_retry_after_and_an_openai_server_says_it_read_spans_as_text():
    async def later_then_answer(k, writer):
        if k == 0:
            writer.write(http_response("429 Too Many Requests", b'{"error": {"message": "slow down"}}',
                                       "application/json").replace(b"\r\n\r\n", b"\r\nRetry-After: 1\r\n\r\n", 1))
        else:
            writer.write(http_response("200 OK", sse(chunk("ok", "stop"), "[DONE]"), "text/event-stream"))

    call = generate(cross(plus("doc A", "doc B"), user("Which?")), max_tokens=4, recompute="first")
    async with scripted_server(later_then_answer) as (url, received), OpenAIBackend(url, model="tiny") as backend:
        started = asyncio.get_running_loop().time()
        completion = await backend.generate(call)
        waited = asyncio.get_running_loop().time() - started
    assert completion.text == "ok" and len(received) == 2 and waited >= 0.9
    assert "plain text" in completion.metrics.fallback and "recompute" in completion.metrics.fallback
    async with scripted_server(later_then_answer) as (url, _), OpenAIBackend(url, model="tiny", max_retries=0) as b:
        with pytest.raises(BackendUnavailableError, match="429"):
            await b.generate(generate(user("hi"), max_tokens=4))


# --------------------------------------------------------------------------------------------- SpanBackend's protocol


async def test_span_backend_posts_the_query_and_reads_span_usage():
    from spanq_integrations.query.spnl_json import to_json

    usage = {
        "prompt_tokens": 40,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 32},
        "padded_tokens": 5,
        "prepared_spans": 2,
    }
    body = sse(
        chunk("Pa"),
        chunk("ris", "stop"),
        {"object": "chat.completion.chunk", "choices": [], "usage": usage},
        "[DONE]",
    )
    reply = http_response("200 OK", body, "text/event-stream")
    call = generate(
        cross(system("Answer briefly."), plus("doc A", "doc B"), user("Capital of France?")),
        model="spnl/tiny",
        max_tokens=4,
    )
    async with (
        raw_http_server(lambda head, body: reply) as (url, received),
        SpanBackend(f"{url}/v1") as backend,
    ):
        assert backend.capabilities.span_aware
        completion = await backend.generate(call, path="$.x")
    head, sent = received[0]
    assert head.startswith(b"POST /v1/query/execute?stream=true&format=spanq HTTP/1.1")
    assert json.loads(sent) == json.loads(json.dumps(to_json(call)))
    assert completion.text == "Paris"
    m = completion.metrics
    assert (
        m.path,
        m.prompt_tokens,
        m.cached_tokens,
        m.generated_tokens,
        m.padded_tokens,
        m.prepared_spans,
    ) == ("$.x", 40, 32, 2, 5, 2)


async def test_span_backend_maps_server_errors_by_type():
    error = {"error": {"message": "$.g.input: expected a query node", "type": "QueryParseError"}}
    reply = http_response("400 Bad Request", json.dumps(error).encode(), "application/json")
    async with raw_http_server(lambda head, body: reply) as (url, _), SpanBackend(url) as backend:
        with pytest.raises(QueryParseError) as info:
            await backend.generate(generate(user("hi")))
    assert info.value.path == "$.g.input"


async def test_span_backend_executes_a_whole_query_remotely():
    from spanq_integrations.query.spnl_json import to_json

    query = generate(user("Capital of France?"), max_tokens=4)
    closed = to_json(Assistant(text="Paris", source=query))
    answer = {
        "result": closed,
        "answer": "Paris",
        "usage": {"prompt_tokens": 9, "completion_tokens": 1},
        "calls": [{"path": "$", "model": "tiny", "ttft_s": 0.01, "prompt_tokens": 9, "generated_tokens": 1}],
    }
    reply = http_response("200 OK", json.dumps(answer).encode(), "application/json")
    async with raw_http_server(lambda head, body: reply) as (url, received), SpanBackend(url) as backend:
        result = await backend.execute_remote(query)
    assert received[0][0].startswith(b"POST /v1/query/execute?stream=false&format=spanq ")
    assert json.loads(received[0][1]) == json.loads(json.dumps(to_json(query)))
    assert result.tree == Assistant(text="Paris", source=query)
    assert result.answer == "Paris"
    assert [c.path for c in result.calls] == ["$"] and result.calls[0].prompt_tokens == 9


# --------------------------------------------------------------------------------------------- the real server


@pytest.fixture
async def backend(stock_vllm_server) -> AsyncIterator[OpenAIBackend]:
    async with OpenAIBackend(f"{stock_vllm_server}/v1", model="tiny", api_key=STOCK_API_KEY) as b:
        yield b


@pytest.mark.vllm
async def test_generate_returns_text_and_measured_metrics(backend):
    completion = await backend.generate(
        generate(cross(system("You are terse."), user("Name a colour.")), max_tokens=8, temperature=0),
        path="$.a",
    )
    m = completion.metrics
    assert completion.text
    assert completion.finish_reasons == ["length"] or completion.finish_reasons == ["stop"]
    assert m.path == "$.a" and m.model == "tiny"
    assert m.ttft_s is not None and 0 < m.ttft_s <= m.wall_s
    assert m.prompt_tokens > 0 and m.generated_tokens > 0


@pytest.mark.vllm
async def test_repeated_long_prompt_hits_the_prefix_cache(backend):
    call = generate(user(long_prompt()), max_tokens=4, temperature=0)
    cold = (await backend.generate(call)).metrics
    warm = (await backend.generate(call)).metrics
    assert cold.prompt_tokens > 500
    assert cold.cached_tokens == 0
    assert (
        cold.prompt_tokens - 32 <= warm.cached_tokens < cold.prompt_tokens
    )  # all whole blocks but the last token's


@pytest.mark.vllm
async def test_n_returns_each_choice(backend):
    completion = await backend.generate(
        generate(user("Say something."), max_tokens=6, temperature=1.0, n=2, seed=3)
    )
    assert len(completion.texts) == 2 and all(completion.texts)


@pytest.mark.vllm
async def test_on_token_pieces_concatenate_to_the_text(backend):
    pieces: list[str] = []

    async def collect(piece: str) -> None:
        pieces.append(piece)

    completion = await backend.generate(
        generate(user("Count to five."), max_tokens=12, temperature=0), on_token=collect
    )
    assert len(pieces) > 1
    assert "".join(pieces) == completion.text


@pytest.mark.vllm
async def test_provider_prefix_and_default_model(stock_vllm_server):
    async with OpenAIBackend(stock_vllm_server, api_key=STOCK_API_KEY) as backend:  # no model: the server's first
        plain = await backend.generate(generate(user("Hi"), max_tokens=2))
        prefixed = await backend.generate(generate(user("Hi"), model="vllm/tiny", max_tokens=2))
    assert plain.metrics.model == prefixed.metrics.model == "tiny"


@pytest.mark.vllm
def test_the_api_key_reaches_a_server_that_wants_one(stock_vllm_server, monkeypatch):
    """The stock server wants a key (`STOCK_API_KEY`): `execute` on its URL sends $SPANQ_API_KEY, or `api_key=`
    of the one resolver; without either the call is refused, saying what is missing. `execute(api_key=)` and
    `judge(api_key=)`, which the refusal names, take it (a TypeError once); a wrong key is said to be refused, not
    missing."""
    from spanq_integrations import ReducerParseError, execute, judge, resolve_backend

    query = generate(user("Hi"), model="tiny", max_tokens=2, temperature=0)
    assert execute(query, stock_vllm_server).answer  # the key from the environment
    with pytest.raises(BackendError, match="HTTP 401.*refused the API key sent"):
        execute(query, stock_vllm_server, api_key="not-the-key")  # (the caller's key wins over the environment's)
    monkeypatch.delenv("SPANQ_API_KEY")
    with pytest.raises(BackendError, match=r"HTTP 401.*wants an API key; pass api_key= \(execute, judge.*or set SPANQ_API_KEY"):
        execute(query, stock_vllm_server)
    assert execute(query, stock_vllm_server, api_key=STOCK_API_KEY).answer
    try:
        calls = judge(["a", "b"], "Pick one.", k=None, reducer="select", backend=stock_vllm_server, model="tiny",
                      max_tokens=2, api_key=STOCK_API_KEY).calls
    except ReducerParseError as e:  # (the tiny model's answer need not name a candidate)
        calls = e.result.calls
    assert len(calls) == 1, "the judge ran on the server with the key it was given"
    backend, owned = resolve_backend(stock_vllm_server, api_key=STOCK_API_KEY)
    assert owned
    try:
        assert execute(query, backend).answer
    finally:
        asyncio.run(backend.aclose())


@pytest.mark.vllm
def test_spanq_backend_in_the_environment_is_where_calls_that_name_none_run(stock_vllm_server, monkeypatch, tmp_path,
                                                                            capsys):  # fmt: skip
    """#32, one resolver: `$SPANQ_BACKEND` was read by LangChain's model alone; `execute(q)`, LlamaIndex's
    `SpanQueryLLM()` and `spanq run` without `--backend` started the embedded engine instead (and this test failed
    at its first check). The resolver reads it now, for every caller that names no backend; a bad value is named
    as the variable's."""
    from spanq_integrations import SpanQueryError, execute, resolve_backend
    from spanq_integrations.cli import main
    from spanq_integrations.llamaindex import SpanQueryLLM

    monkeypatch.setenv("SPANQ_BACKEND", stock_vllm_server)
    backend, owned = resolve_backend(None, "tiny")
    try:
        assert owned and isinstance(backend, OpenAIBackend), backend
        assert backend.base_url == normalize_base_url(stock_vllm_server)
    finally:
        asyncio.run(backend.aclose())
    query = generate(user("Hi"), model="tiny", max_tokens=2, temperature=0)
    assert execute(query).calls[-1].model == "tiny"  # the stock server's model, not the embedded engine's
    llm = SpanQueryLLM(model="tiny", max_tokens=2, temperature=0.0)
    try:
        assert [c["model"] for c in llm.complete("Hi").raw["spanq"]["per_call"]] == ["tiny"]
    finally:
        llm.close()
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"g": {"model": "tiny", "input": {"user": "Hi"}, "max_tokens": 2, "temperature": 0}}))
    assert main(["run", str(path), "--json"]) == 0
    assert [c["model"] for c in json.loads(capsys.readouterr().out)["calls"]] == ["tiny"]
    monkeypatch.setenv("SPANQ_BACKEND", "ftp://nowhere")
    with pytest.raises(SpanQueryError, match=r"^\$SPANQ_BACKEND: unknown backend 'ftp://nowhere'"):
        resolve_backend(None)


@pytest.mark.vllm
async def test_unknown_model_names_it_and_the_served_ones(backend):
    with pytest.raises(ModelNotFoundError, match=r"'no-such-model'.*serves tiny"):
        await backend.generate(generate(user("hi"), model="no-such-model", max_tokens=2))


@pytest.mark.vllm
async def test_overlong_prompt_is_a_context_length_error(backend):
    with pytest.raises(ContextLengthError):
        await backend.generate(generate(user(long_prompt(words=5000)), max_tokens=2))
