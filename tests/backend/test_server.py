"""`spanq serve` on the tiny model: stock OpenAI routes, `POST /v1/query/execute` and `SpanBackend` against it.

One server for the module, started as `python -m spanq_integrations.cli serve` in its own process group; its
log tail is printed if a test fails.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spanq_integrations import (
    Assistant,
    ContextLengthError,
    ModelNotFoundError,
    cross,
    fragment,
    generate,
    plus,
    system,
    user,
)
from spanq_integrations.backends.span import SpanBackend
from spanq_integrations.query.spnl_json import from_json, to_json
from tests.backend.settings import temporarily
from tests.integrations.spnl_reader import read_chat_completion, read_completion, read_completion_stream
from tests.servers import SpanqServe

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXECUTE = "/v1/query/execute"

DOCS = {
    c: f"Document {c}. "
    + " ".join(
        f"The {w} of {c} is {i}."
        for i, w in enumerate(["key", "door", "lamp", "road", "tree", "bell", "cup"] * 3)
    )
    for c in "ABCD"
}


OTHER_INSTRUCTION = "Answer from these documents."


def rag_query(order: str, max_tokens: int = 6, docs: dict[str, str] = DOCS, instruction: str = "Answer from the documents."):
    """A RAG query over `docs` in `order`. Under the instruction of an earlier query that read the same documents in
    context, the server reads them in context again (in that query's order, `SpanGenerator.in_context`); under
    another (`OTHER_INSTRUCTION`) it reads them as spans."""
    return generate(
        cross(
            system(instruction),
            plus(*[fragment(docs[c]) for c in order]),
            user("Which door?"),
        ),
        max_tokens=max_tokens,
        temperature=0.0,
    )


# --------------------------------------------------------------------------------------------- the server


@pytest.fixture
def server(spanq_serve: SpanqServe) -> SpanqServe:
    """The session's `spanq serve` on the tiny model (tests/conftest.py), which the judge tests use too."""
    return spanq_serve


def _gauge(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert found, f"/metrics has no vllm:{name}"
    return float(found.group(1))


def wait_until_prepared(url: str, texts, timeout_s: float = 60.0) -> None:
    """Wait until the server's engine holds every one of these documents as a span (`GET /v1/spans`): a cold query
    computes its documents in context and prepares them alone once the engine is idle."""
    from spanq_backend.serving.lowering import span_digest

    wanted = {span_digest(t) for t in texts}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if wanted <= set(httpx.get(f"{url}/v1/spans", timeout=10).json()["spans"]):
            return
        time.sleep(0.2)
    pytest.fail(f"the server did not prepare {len(wanted)} documents within {timeout_s} s")


def test_deferred_prepares_wait_for_a_stock_request_under_way(server: SpanqServe):
    """A span query over new documents reads them in context and prepares them alone when the engine is idle. A
    stock chat completion running meanwhile (vLLM's own route, beside spanq's) keeps the engine busy: the prepares
    wait for its end (they ran beside it, and its decode at a sixth of its speed: SmolLM2, 64 tokens at 4 tokens/s
    against 28), then run."""
    import threading

    from spanq_backend.serving.lowering import span_digest

    new = {c: f"Ledger {c} (stock-beside). " + " ".join(f"The {w} of {c} rings {i}." for i, w in
                                                         enumerate(["bell", "gong", "horn"] * 4)) for c in "PQR"}  # fmt: skip
    asyncio.run(_generate(server.url, generate(user("Hi"), max_tokens=1)))  # (the server's span backend made)
    streaming, ended = threading.Event(), threading.Event()

    def long_stock_answer() -> None:
        body = {"model": server.served_name, "max_tokens": 3900, "temperature": 0, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "Count on."}]}  # fmt: skip
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as answer:
            for _ in answer.iter_lines():
                streaming.set()
                if ended.is_set():
                    break  # (the client goes away: vLLM aborts the request, and its route's count ends)

    stock = threading.Thread(target=long_stock_answer)
    stock.start()
    try:
        assert streaming.wait(60), "the stock answer did not start"
        result = asyncio.run(_generate(server.url, rag_query("PQR", docs=new, instruction="Answer from the ledgers.")))
        assert result.metrics.deferred_spans == 3, result.metrics
        wanted = {span_digest(t) for t in new.values()}
        for _ in range(15):  # 3 s of the stock answer still streaming: none of them prepared beside it
            held = wanted & set(httpx.get(f"{server.url}/v1/spans", timeout=10).json()["spans"])
            alive = stock.is_alive()
            assert alive, "the stock answer ended before the check did: make it longer"
            assert not held, f"{len(held)} prepared while a stock answer ran"
            time.sleep(0.2)
    finally:
        ended.set()
        stock.join()
    wait_until_prepared(server.url, new.values())  # and once it is gone, they are


def documents_warm(server: SpanqServe) -> None:
    """DOCS held as spans by the server, whichever tests ran before (the server reads new documents in context
    and prepares them when idle): a test that compares warm answers or counts cached tokens starts from here."""
    asyncio.run(_run_once(server.url, rag_query("ABCD")))
    wait_until_prepared(server.url, DOCS.values())


async def _run_once(url: str, query) -> None:
    async with SpanBackend(url) as backend:
        await backend.generate(query)


# --------------------------------------------------------------------------------------------- tests


def test_stock_chat_completions_still_work(server: SpanqServe):
    answer = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": server.served_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert isinstance(body["choices"][0]["message"]["content"], str)
    assert body["usage"]["completion_tokens"] == 4
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [server.served_name, "tiny"]


@pytest.mark.parametrize("name", ["tiny", "listed first", ""])
def test_a_client_names_the_model_as_the_server_was_started_as_listed_or_not_at_all(server: SpanqServe, name):
    """`spanq serve --model tiny`: "tiny", the name /v1/models lists first, or no name, on every route."""
    model = server.served_name if name == "listed first" else name
    query = generate(user("Hi"), model=model, max_tokens=2, temperature=0)
    executed = httpx.post(f"{server.url}{EXECUTE}", json=to_json(query), timeout=60)
    assert executed.status_code == 200, executed.text
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **({"model": model} if model else {})}
    chat = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == server.served_name  # answers name the model as /v1/models lists it first


@pytest.mark.parametrize("provider", ["openai/", "spnl/"])
def test_a_model_named_as_spnl_names_it_runs_on_the_span_route_as_on_the_stock_one(server: SpanqServe, provider):
    """spnl's query files name models "provider/name". Read through `OpenAIBackend` (the stock route), the provider
    is dropped; the span route refused the same query as an unknown model (404)."""
    from spanq_integrations import execute

    query = generate(user("Hi"), model=f"{provider}tiny", max_tokens=2, temperature=0)
    executed = httpx.post(f"{server.url}{EXECUTE}", json=to_json(query), timeout=60)
    assert executed.status_code == 200, executed.text
    assert execute(query, f"spanq+{server.url}").calls[0].generated_tokens == 2
    assert execute(query, server.url).calls[0].generated_tokens == 2  # (the stock route, as it always ran)


def test_the_servers_kv_event_socket_names_its_process(server: SpanqServe):
    import os
    import tempfile

    from spanq_backend.serving.server import KV_SOCKET_PREFIX

    ours = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"{KV_SOCKET_PREFIX}{server.pid}-")]
    assert len(ours) == 1, "the running server's socket names its process (what the sweep below reads)"


def test_a_killed_servers_kv_event_socket_is_swept_by_the_next_server_and_a_live_ones_is_kept():
    """A server's KV-event socket carries its process id. One left by a server that was killed (its process gone,
    nothing listening) is removed when the next server picks its socket; a live server's, a socket whose process
    lives and anything else are kept."""
    import os
    import socket
    import subprocess
    import sys
    import tempfile

    from spanq_backend.serving.server import KV_SOCKET_PREFIX, kv_events_socket_path, sweep_stale_kv_sockets

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process id that no longer exists
    folder = Path(tempfile.mkdtemp(prefix="kv", dir="/tmp"))
    try:
        def unix_socket(name: str, listening: bool) -> socket.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(folder / name))
            if listening:
                sock.listen(1)
            else:
                sock.close()  # the file stays, as a killed server leaves it
            return sock

        unix_socket(f"{KV_SOCKET_PREFIX}{gone.pid}-dead", listening=False)
        live = unix_socket(f"{KV_SOCKET_PREFIX}{gone.pid}-listening", listening=True)
        unix_socket(f"{KV_SOCKET_PREFIX}{os.getpid()}-mine", listening=False)
        unix_socket(f"{KV_SOCKET_PREFIX}old-name", listening=False)
        (folder / f"{KV_SOCKET_PREFIX}{gone.pid}-file").write_text("not a socket")
        removed = sweep_stale_kv_sockets(str(folder))
        live.close()
        assert removed == [str(folder / f"{KV_SOCKET_PREFIX}{gone.pid}-dead")]
        assert sorted(n.name for n in folder.iterdir()) == sorted(
            f"{KV_SOCKET_PREFIX}{x}" for x in (f"{gone.pid}-listening", f"{os.getpid()}-mine", "old-name", f"{gone.pid}-file")
        )
        # the server's own choice of socket sweeps its folder first
        unix_socket(f"{KV_SOCKET_PREFIX}{gone.pid}-dead", listening=False)
        with temporarily(tempfile, tempdir=str(folder)):
            path = kv_events_socket_path()
        assert path.startswith(f"{folder}/{KV_SOCKET_PREFIX}{os.getpid()}-")
        assert not (folder / f"{KV_SOCKET_PREFIX}{gone.pid}-dead").exists()
    finally:
        for entry in folder.iterdir():
            entry.unlink()
        folder.rmdir()


def test_reordered_fragments_are_served_from_the_span_cache(server: SpanqServe, tiny_model: Path):
    from spanq_backend.serving.generator import load_chat_tokenizer
    from spanq_backend.serving.lowering import lower

    new = {c: text.replace("Document", "Record") for c, text in DOCS.items()}  # this server has not seen them

    async def scenario():
        async with SpanBackend(server.url) as backend:
            first = await backend.generate(rag_query("ABCD", docs=new))
            wait_until_prepared(server.url, new.values())
            again = await backend.generate(rag_query("DCBA", docs=new))
            # (nothing recomputed: every span block read from the cache; the default recomputes one block a span)
            second = await backend.generate(
                rag_query("DCBA", docs=new, instruction=OTHER_INSTRUCTION).model_copy(update={"recompute": 0})
            )
            return first, again, second

    first, again, second = asyncio.run(scenario())
    tokenizer = load_chat_tokenizer(tiny_model)
    # The same instruction: the documents are cached in context in the first query's order (the server follows its
    # cache through KV events), and read so: the stock prompt in ABCD order, all of it cached but its last block.
    from spanq_backend.serving.generator import flattened_prompt_ids

    stock_ids = flattened_prompt_ids(tokenizer, rag_query("ABCD", docs=new).input)
    assert again.metrics.prompt_tokens == len(stock_ids) and again.metrics.padded_tokens == 0
    assert again.metrics.cached_tokens >= len(stock_ids) - 32 and again.metrics.prepared_spans == 0
    # Another instruction: not cached in context after it; the documents are read as spans.
    lowered = lower(
        rag_query("DCBA", docs=new, instruction=OTHER_INSTRUCTION).input, tokenizer, 32,
        tokenizer.encode("\n", add_special_tokens=False)[-1],
    )
    span_tokens = sum(e - s for s, e in lowered.table.spans)
    assert len(lowered.table.spans) == 4
    # All four fragments were new: computed in context by the first query and prepared alone after it.
    assert first.metrics.prepared_spans == 0 and first.metrics.deferred_spans == 4
    assert second.metrics.prepared_spans == 0 and second.metrics.deferred_spans == 0, "every fragment was cached"
    assert second.metrics.cached_tokens >= span_tokens, (
        f"cached {second.metrics.cached_tokens} tokens; the fragments are {span_tokens}"
    )
    assert second.metrics.prompt_tokens == len(lowered.token_ids)
    assert second.metrics.model == server.served_name
    assert second.metrics.ttft_s is not None and second.text


def _counter(url: str, name: str) -> float:
    """Sum of a vLLM counter over its labels, from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))


def test_cached_fragments_send_no_prepare_requests(server: SpanqServe):
    """The route follows the engine's prefix cache through vLLM's KV events: fragments it knows are cached
    are not prepared again; the engine finishes exactly one request for the reordered query."""
    fresh = {c: f"Memo {c}: " + " ".join(f"the {c} valve reads {i}." for i in range(40)) for c in "ABCD"}

    def query(order: str):
        return generate(
            cross(system("Answer from the memos."), plus(*[fragment(fresh[c]) for c in order]), user("Which valve?")),
            max_tokens=3, temperature=0.0,
        )

    async def scenario():
        async with SpanBackend(server.url) as backend:
            first = await backend.generate(query("ABCD"))
            wait_until_prepared(server.url, fresh.values())  # the events of the prepares have arrived too
            # (another order first: the span layout's padded prefix, which the stock-laid-out cold query did not
            # leave, is computed once)
            await backend.generate(query("DCBA"))
            await asyncio.sleep(0.5)  # events are published after each engine step
            before = _counter(server.url, "request_success_total")
            second = await backend.generate(query("CADB"))
            return first, second, _counter(server.url, "request_success_total") - before

    first, second, finished = asyncio.run(scenario())
    assert first.metrics.deferred_spans == 4
    assert second.metrics.prepared_spans == 0
    assert finished == 1, f"{finished} requests ran for a query whose four fragments were all cached"
    assert second.metrics.cached_tokens >= 4 * 32


def test_documents_posted_to_the_server_are_prepared_pinned_and_read_from_the_cache_until_unpinned(server: SpanqServe):
    """`POST /v1/spans` prepares a corpus as the queries over it will read it and, with `"pin": true`, pins its
    blocks in the engine's KV cache (through the engine core: `EngineCore.spanq_pin_blocks`); a query over it then
    prepares nothing and reads nothing in context; `DELETE /v1/spans/pin` drops the pins. (That a pinned block
    outlives the cache's pressure is tests/backend/test_pins.py, on the same engine core pins.)"""
    corpus = [f"Logbook {c}: " + " ".join(f"the {c} buoy drifted {i} miles." for i in range(30)) for c in "PQR"]
    url = server.url
    try:
        report = httpx.post(f"{url}/v1/spans", json={"documents": corpus, "pin": True}, timeout=120).json()
        assert report["documents"] == report["spans"] == report["prepared"] == 3 and report["tokens"] > 0, report
        assert report["pinned_blocks"] > 0 and report["pin_refused"] == report["pin_missing"] == 0, report
        assert httpx.get(f"{url}/v1/spans/pin", timeout=30).json()["pinned_blocks"] == report["pinned_total"]
        wait_until_prepared(url, corpus)  # (the route's own events have reached its cache mirror)
        # again: all held, nothing computed, nothing pinned twice
        again = httpx.post(f"{url}/v1/spans", json={"documents": corpus, "pin": True}, timeout=120).json()
        assert again["held"] == 3 and again["prepared"] == again["tokens"] == again["pinned_blocks"] == 0, again
        assert again["pinned_total"] == report["pinned_total"]
        query = generate(cross(plus(*[fragment(t) for t in reversed(corpus)]), user("Which buoy?")), max_tokens=2,
                         temperature=0.0)  # fmt: skip
        result = asyncio.run(_generate(url, query))
        assert result.metrics.prepared_spans == 0 and result.metrics.deferred_spans == 0, result.metrics
        assert result.metrics.cached_tokens >= 0.8 * result.metrics.prompt_tokens, result.metrics  # the documents
    finally:
        dropped = httpx.delete(f"{url}/v1/spans/pin", timeout=30).json()
    assert dropped["unpinned_blocks"] == report["pinned_total"]
    assert httpx.get(f"{url}/v1/spans/pin", timeout=30).json()["pinned_blocks"] == 0


async def _generate(url: str, query):
    async with SpanBackend(url) as backend:
        return await backend.generate(query)


@pytest.mark.parametrize(
    ("body", "path"),
    [
        (b"{", "$"),
        (b"[]", "$"),
        (b'{"documents": []}', "$.documents"),
        (b'{"documents": ["fine", 7]}', "$.documents[1]"),
        (b'{"documents": ["fine", {"title": "no text"}]}', "$.documents[1]"),
        (b'{"documents": ["fine"], "pin": "yes"}', "$.pin"),
        (b'{"docs": ["fine"]}', "$.docs"),
        (b'{"documents": ["\\ud800"]}', "$.documents[0]"),
    ],
)
def test_a_bad_corpus_body_is_a_400_naming_what_is_wrong_and_pins_nothing(server: SpanqServe, body: bytes, path: str):
    response = httpx.post(f"{server.url}/v1/spans", content=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith(f"{path}:"), response.text
    assert httpx.get(f"{server.url}/v1/spans/pin", timeout=30).json()["pinned_blocks"] == 0


def test_spanq_prepare_sends_a_corpus_to_a_server_which_prepares_and_pins_it(server: SpanqServe, tmp_path, capsys):
    """`spanq prepare CORPUS --server URL --pin`: the corpus file as `spanq prepare --tier-dir` reads it (bad lines
    named and skipped), prepared and pinned on the running server; a server that is not there is one clear error."""
    from spanq_backend.serving.prepare import prepare_main

    corpus = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"page_content": f"Chart {c}: " + " ".join(f"the {c} reef lies {i} fathoms." for i in range(25))})
             for c in "XY"]  # fmt: skip
    corpus.write_text("\n".join([lines[0], "17", lines[1]]) + "\n")
    try:
        assert prepare_main([str(corpus), "--server", server.url, "--pin", "--json"]) == 1  # (a line was skipped)
        out, err = capsys.readouterr()
        report = json.loads(out)
        assert report["documents"] == 2 and report["prepared"] + report["held"] == 2 and report["pinned_total"] > 0
        assert report["skipped_lines"] == 1 and ":2: not a document" in err
        # An OpenAI base URL, as `spanq run --backend` takes it: the same server (it asked /v1/v1/spans, a 404)
        assert prepare_main([str(corpus), "--server", f"{server.url}/v1/", "--json"]) == 1
        assert json.loads(capsys.readouterr().out)["documents"] == 2
    finally:
        httpx.delete(f"{server.url}/v1/spans/pin", timeout=30)
    down = f"http://127.0.0.1:{_closed_port()}"
    assert prepare_main([str(corpus), "--server", down]) == 2
    assert f"cannot reach {down}" in capsys.readouterr().err


def _closed_port() -> int:
    from tests.servers import free_port

    return free_port()


SPAN_COUNTERS = ("span_calls", "spans_prepared", "spans_hit", "prepared_tokens", "padding_tokens",
                 "prepare_requests_saved", "blocks_relocated", "span_duplicates", "relocation_seconds", "deferred_spans",
                 "in_context_calls")


def _spanq_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for name in SPAN_COUNTERS:
        assert re.search(rf"^# TYPE spanq_{name}(_total)? counter$", text, re.MULTILINE), f"no counter spanq_{name}"
        out[name] = float(re.search(rf"^spanq_{name}_total (\S+)$", text, re.MULTILINE).group(1))
    return out


def _settled_counters(url: str, timeout_s: float = 20.0) -> dict[str, float]:
    """The counters once two reads 0.3 s apart agree: a deferred prepare is counted when its request's answer
    reaches the server, a moment after its blocks show as cached (what `wait_until_prepared` sees)."""
    deadline = time.monotonic() + timeout_s
    last = _spanq_counters(url)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = _spanq_counters(url)
        if now == last:
            return now
        last = now
    return last


def test_a_metrics_scrape_waits_for_a_busy_engine_core_one_second_at_most_and_scrapes_share_one_read(
    monkeypatch,
):
    """/metrics reads the engine core's counters at each scrape (`before_metrics`); the engine core answers between
    two steps, seconds apart on a CPU (a long prefill), so a scrape waits `METRICS_WAIT_S` at most and shows the
    last counters read, and scrapes meanwhile share one read, whose answer is shown from then on. The engine core
    in a long step is stood for by an `engine_client` whose read takes 3 s (the tiny model's steps are ms)."""
    import types

    from spanq_backend.serving import metrics, query_route

    reads: list[float] = []

    class EngineCoreInALongStep:
        async def collective_rpc(self, method: str) -> list[dict]:
            reads.append(time.monotonic())
            await asyncio.sleep(3.0)
            return [{"runtimes": 1, "moved_blocks": 7}]

    router = query_route.build_query_router(None, ["m"])
    app = types.SimpleNamespace(state=types.SimpleNamespace(spanq_backend=types.SimpleNamespace(
        engine_client=EngineCoreInALongStep())))  # fmt: skip
    monkeypatch.setattr(metrics, "_engine_stats", {})
    monkeypatch.setattr(metrics, "_worker_stats", lambda: metrics._engine_stats or None)  # (no engine runs here)

    async def scrapes() -> list[float]:
        waited = []
        for _ in range(2):
            started = time.monotonic()
            await router.spanq_before_metrics(app)
            waited.append(time.monotonic() - started)
        await asyncio.sleep(3.0)  # the read ends
        return waited

    waited = asyncio.run(scrapes())
    assert all(w < query_route.METRICS_WAIT_S + 0.5 for w in waited), waited
    assert len(reads) == 1, "the second scrape shares the read the first started"
    assert metrics.snapshot()["blocks_relocated"] == 7


def test_span_counters_are_on_metrics_and_move_when_spans_are_reused(server: SpanqServe):
    fresh = {c: f"Invoice {c}: " + " ".join(f"line {i} of {c} costs {i * 7 % 11}." for i in range(30)) for c in "ABCD"}

    def query(order: str, instruction: str = "Answer from the invoices."):
        return generate(
            cross(system(instruction), plus(*[fragment(fresh[c]) for c in order]), user("Total?")),
            max_tokens=2, temperature=0.0,
        )  # fmt: skip

    async def scenario():
        async with SpanBackend(server.url) as backend:
            first = await backend.generate(query("ABCD"))
            wait_until_prepared(server.url, fresh.values())  # prepared alone, off the first query's path
            # (another instruction: the invoices are read as spans, not in context again after the first's)
            return first, await backend.generate(query("DBCA", "Answer from these invoices."))

    async def any_query():  # the engine's counters are on /metrics once a query has run
        async with SpanBackend(server.url) as backend:
            await backend.generate(generate(cross(plus(fragment("warm")), user("Hi")), max_tokens=1))

    asyncio.run(any_query())
    wait_until_prepared(server.url, ["warm"])  # its own deferred prepare is done before the counters are read
    before = _settled_counters(server.url)  # and counted (the suite once read it between the two: 5 prepared)
    first, second = asyncio.run(scenario())
    delta = {k: v - before[k] for k, v in _settled_counters(server.url).items()}
    assert delta["span_calls"] == 2
    # The first call computed its four new documents in context (no span of its own); they were prepared alone
    # after it, off every call's path (counted as prepared spans and tokens, not as any call's).
    assert first.metrics.deferred_spans == 4 and first.metrics.prepared_spans == 0
    assert delta["spans_prepared"] == 4 and delta["deferred_spans"] == 4
    assert delta["spans_hit"] == 4  # the second call found all four
    assert delta["prepared_tokens"] > first.metrics.prepared_tokens
    assert delta["padding_tokens"] == first.metrics.padded_tokens + second.metrics.padded_tokens
    # the second call sent none of its four span prepares (a prefix prepare either call skipped counts too)
    assert 4 <= delta["prepare_requests_saved"] <= 6
    assert delta["blocks_relocated"] > 0 and delta["relocation_seconds"] > 0  # DBCA moved cached keys
    assert delta["span_duplicates"] == 0  # one reader at a time: no private copies


def test_execute_without_streaming_returns_the_closed_tree_and_usage(server: SpanqServe):
    documents_warm(server)
    query = rag_query("BADC", instruction=OTHER_INSTRUCTION)  # read as spans (padded), not in context again
    answer = httpx.post(f"{server.url}{EXECUTE}", json=to_json(query), timeout=120)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    tree = from_json(body["result"])
    assert isinstance(tree, Assistant) and tree.source is not None
    assert tree.text == body["answer"] and body["answer"]
    usage = body["usage"]
    assert usage["completion_tokens"] == 6
    assert usage["prompt_tokens"] > usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert usage["padded_tokens"] > 0 and "prepared_spans" in usage
    (call,) = body["calls"]
    assert call["path"] == "$" and call["prompt_tokens"] == usage["prompt_tokens"]

    async def remote():
        async with SpanBackend(server.url) as backend:
            return await backend.execute_remote(query)

    result = asyncio.run(remote())
    assert result.answer == body["answer"]  # temperature 0, the same spans
    assert result.calls[0].cached_tokens > 0
    assert body["unread"] == [] and result.unread == []


def test_an_answer_a_remote_combine_cannot_read_is_named_in_the_result(server: SpanqServe):
    """Judges made to answer a word (constrained decoding), not a count: a combine in code run by the server
    leaves their answers out, and the result the client gets names each one, as a local run does."""
    from spanq_integrations.query.ir import combine

    word = {"type": "object", "properties": {"a": {"enum": ["none"]}}, "required": ["a"]}
    leaves = plus(*(generate(user(f"How many cats in text {i}?"), max_tokens=16, temperature=0.0, json_schema=word)
                    for i in range(2)))  # fmt: skip

    async def remote():
        async with SpanBackend(server.url) as backend:
            return await backend.execute_remote(combine(leaves, "count"))

    result = asyncio.run(remote())
    assert sorted(c.path for c in result.calls) == ["$.combine.input.plus[0]", "$.combine.input.plus[1]"]
    assert [u.path for u in result.unread] == ["$.combine.input.plus[0]", "$.combine.input.plus[1]"]
    assert all("count reducer cannot parse" in u.error and '"none"' in u.error for u in result.unread)
    assert result.answer == ""  # nothing was counted


def _first_call(server: SpanqServe, query) -> dict:
    """The first generate call's report of `query` executed on the server (a 200 asserted)."""
    answer = httpx.post(f"{server.url}{EXECUTE}", json=to_json(query), timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["calls"][0]


def test_recompute_travels_with_the_query_and_a_bad_setting_is_a_400(server: SpanqServe):
    """`"recompute"` on a `g`: the server recomputes the chosen blocks in context (after the spans were prepared by
    another order), counts them, and the same query again finds them cached; a bad value is a 400 naming it."""
    httpx.post(f"{server.url}{EXECUTE}", json=to_json(rag_query("CDAB")), timeout=120).raise_for_status()
    # (another instruction than the one the documents may be cached in context after: they are read as spans)
    query = rag_query("ADBC", instruction=OTHER_INSTRUCTION).model_copy(update={"recompute": "first"})
    first, again = (_first_call(server, query) for _ in range(2))
    assert first["extra"]["recomputed_tokens"] == 4 * 32  # each document's first block
    assert first["prepared_spans"] == 0 and first["prepared_tokens"] >= 3 * 32  # runs before later spans
    assert again["prepared_tokens"] <= 4, "the recomputed blocks were cached by the first run"
    plain = httpx.post(
        f"{server.url}{EXECUTE}",
        json=to_json(rag_query("ADBC", instruction=OTHER_INSTRUCTION).model_copy(update={"recompute": 0})),
        timeout=120,
    ).json()["calls"][0]
    assert plain["extra"]["recomputed_tokens"] == 0
    bad = _post_raw(server, '{"g":{"max_tokens":1,"recompute":"most","input":{"user":"hi"}}}')
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("$.g.recompute"), bad.text
    _assert_healthy(server)


def test_recompute_by_attention_reads_the_engine_process_s_probe(server: SpanqServe):
    """`"recompute": "attention"`: the probe's pass runs in the engine's process; the server takes its result
    through vLLM's collective_rpc and recomputes as many blocks as spans, without falling back to the words."""
    httpx.post(f"{server.url}{EXECUTE}", json=to_json(rag_query("BDCA")), timeout=120).raise_for_status()
    query = rag_query("CABD", instruction="Answer by attention.").model_copy(update={"recompute": "attention"})
    first, again = (_first_call(server, query) for _ in range(2))
    probe = first["extra"]["attention_probe"]
    assert first["fallback"] is None and "fallback" not in probe, probe
    assert probe["rows"] > 0 and probe["layer"].endswith("self_attn.attn")
    assert first["extra"]["recomputed_tokens"] == 4 * 32
    assert again["extra"]["attention_probe"] == {"reused": True}, "the same prompt: the same blocks, no second pass"
    _assert_healthy(server)


def _as_spnls_client(server: SpanqServe, doc: dict, stream: bool) -> httpx.Response:
    """A request as spnl 0.22's client sends it: the query as text/plain, `?stream=true|false`, no format."""
    return httpx.post(
        f"{server.url}{EXECUTE}",
        params={"stream": "true" if stream else "false"},
        content=json.dumps(doc).encode(),
        headers={"Content-Type": "text/plain"},
        timeout=120,
    )


def test_spnls_own_client_reads_the_answers_of_a_repeat_and_a_map(server: SpanqServe):
    documents_warm(server)  # every request below reads the same spans, so greedy answers are equal
    g = to_json(rag_query("CABD"))["g"]
    ours = httpx.post(f"{server.url}{EXECUTE}", params={"format": "spanq"}, json={"g": g}, timeout=120)
    assert ours.status_code == 200, ours.text
    expected = ours.json()["answer"]
    assert expected

    streamed = _as_spnls_client(server, {"repeat": {"n": 1, "g": g}}, stream=True)
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    assert read_completion_stream(streamed.content, 1) == [expected]

    whole = _as_spnls_client(server, {"repeat": {"n": 2, "g": g}}, stream=False)
    assert whole.status_code == 200, whole.text
    assert read_chat_completion(whole.json()) == [expected, expected]  # temperature 0: both greedy
    assert whole.json()["usage"]["completion_tokens"] == 12

    bulk = {"map": {"metadata": {"model": "", "max_tokens": 4, "temperature": 0.0}, "inputs": ["Say a", "Say b"]}}
    whole = _as_spnls_client(server, bulk, stream=False)
    assert whole.status_code == 200, whole.text
    assert whole.json()["object"] == "text_completion"
    texts = read_completion(whole.json())
    assert len(texts) == 2 and all(texts)
    assert read_completion_stream(_as_spnls_client(server, bulk, stream=True).content, 2) == texts


def _stream_events(body: bytes) -> list[dict]:
    return [json.loads(line[len(b"data: "):]) for line in body.split(b"\n")
            if line.startswith(b"data: ") and line != b"data: [DONE]"]  # fmt: skip


def test_a_streamed_bulk_query_streams_each_answer_and_ends_it_with_its_calls_finish_reason(server: SpanqServe):
    """A top-level `repeat` streamed: every answer token by token under its own index as its call runs (they came
    whole at the end, the response's headers too: a client's read timeout fired on a long bulk job), each ended
    with the finish reason its call ended with ("length" for calls cut at max_tokens), on both wires. The chat
    wire sent only the last answer, always ending in "stop"; spnl's ended every choice with none."""
    g = {"model": "", "input": {"user": "Count slowly from one to fifty."}, "max_tokens": 3, "temperature": 0.0}
    doc = {"repeat": {"n": 2, "g": g}}
    whole = httpx.post(f"{server.url}{EXECUTE}", params={"format": "spanq"}, json=doc, timeout=120)
    assert whole.status_code == 200, whole.text
    assert [c["finish_reasons"] for c in whole.json()["calls"]] == [["length"], ["length"]]
    answers = [child["assistant"]["text"] for child in whole.json()["result"]["plus"]]
    assert len(answers) == 2 and all(answers)

    chat = httpx.post(f"{server.url}{EXECUTE}", params={"stream": "true"}, json=doc, timeout=120)
    assert chat.status_code == 200, chat.text
    choices = [choice for event in _stream_events(chat.content) for choice in event.get("choices", [])]
    pieces = {k: [c["delta"]["content"] for c in choices if c["index"] == k and c["delta"].get("content")] for k in (0, 1)}
    assert ["".join(pieces[0]), "".join(pieces[1])] == answers
    assert all(len(p) > 1 for p in pieces.values()), f"each answer streams as it is generated, not whole: {pieces}"
    assert [(c["index"], c["finish_reason"]) for c in choices if c.get("finish_reason")] == [(0, "length"), (1, "length")]

    spnl = httpx.post(f"{server.url}{EXECUTE}", params={"stream": "true", "format": "spnl"}, json=doc, timeout=120)
    assert spnl.status_code == 200, spnl.text
    assert read_completion_stream(spnl.content, 2) == answers
    spnl_choices = [c for e in _stream_events(spnl.content) for c in e["choices"]]
    assert all(sum(1 for c in spnl_choices if c["index"] == k and c.get("text")) > 1 for k in (0, 1)), spnl_choices
    ended = {c["index"]: c["finish_reason"] for c in spnl_choices}
    assert ended == {0: "length", 1: "length"}


def test_spnls_own_executor_answers_as_spanqs_over_the_openai_route(server: SpanqServe, monkeypatch):
    """spnl 0.22.1's executor (its PyPI package: its own parser, its own OpenAI client) runs queries spanq wrote
    against `spanq serve`'s stock chat route, and at temperature 0 its answers are spanq's own executor's over the
    same route. (The tiny model's answers hang mostly on a prompt's last tokens, so this alone would miss a
    difference earlier in the prompt: that both send the same messages, and where they do not, is checked on the
    requests themselves in tests/integrations/test_spnl_package.py.)"""
    import spnl

    from spanq_integrations import Repeat, execute

    monkeypatch.setenv("OPENAI_API_BASE", f"{server.url}/v1")
    model = f"openai/{server.served_name}"
    conversation = cross(system("Answer briefly."), user("Name a colour."), Assistant(text="Blue."), user("Another?"))
    queries = [
        generate(user("Name a town."), model=model, max_tokens=8, temperature=0.0),
        generate(cross(system("You are terse."), user("Which door?")), model=model, max_tokens=8, temperature=0.0),
        generate(conversation, model=model, max_tokens=8, temperature=0.0),
        # n=1: vLLM refuses n > 1 at temperature 0 in one request ("n must be 1 when using greedy sampling"),
        # which is how spnl sends a repeat
        Repeat(n=1, query=generate(user("Count to three."), model=model, max_tokens=6, temperature=0.0)),
    ]

    def spnls(doc) -> str:
        return asyncio.run(spnl.execute(json.dumps(doc))).data

    for query in queries:
        doc = to_json(query)
        ours = execute(from_json(doc), server.url)  # a plain http URL: the OpenAI-compatible client
        texts = [text for call in ours.calls for text in call.choices]  # a repeat's n choices, in order
        assert len(texts) == 1 and all(texts), ours
        assert spnls(doc) == texts[0], (doc, texts)


def test_the_answer_format_is_negotiated(server: SpanqServe):
    doc = to_json(rag_query("ABCD", max_tokens=2))
    plain = {"Content-Type": "text/plain"}
    spanq_on_plain = httpx.post(
        f"{server.url}{EXECUTE}", params={"format": "spanq"}, content=json.dumps(doc), headers=plain, timeout=120
    )
    assert spanq_on_plain.status_code == 200 and "result" in spanq_on_plain.json()
    spnl_on_json = httpx.post(f"{server.url}{EXECUTE}", params={"format": "spnl"}, json=doc, timeout=120)
    assert spnl_on_json.status_code == 200 and spnl_on_json.json()["object"] == "chat.completion"
    bad = httpx.post(f"{server.url}{EXECUTE}", params={"format": "xml"}, json=doc, timeout=30)
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == "format: unknown answer format 'xml' (one of: spanq, spnl)"


def test_a_malformed_body_is_a_400_naming_the_json_path(server: SpanqServe):
    bad = {"g": {"model": "", "input": {"cross": [{"user": "hi"}, {"usr": "typo"}]}}}
    answer = httpx.post(f"{server.url}{EXECUTE}", json=bad, timeout=30)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "QueryParseError"
    assert error["message"].startswith("$.g.input.cross[1]: ")
    not_json = httpx.post(f"{server.url}{EXECUTE}?stream=true", content=b"{oops", timeout=30)
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "QueryParseError"


def test_an_unknown_model_is_a_404(server: SpanqServe):
    query = generate(user("Hi"), model="gpt-17-ultra", max_tokens=2)
    answer = httpx.post(f"{server.url}{EXECUTE}", json=to_json(query), timeout=30)
    assert answer.status_code == 404
    assert answer.json()["error"]["type"] == "ModelNotFoundError"

    async def through_client():
        async with SpanBackend(server.url) as backend:
            await backend.generate(query)

    with pytest.raises(ModelNotFoundError, match=server.served_name):
        asyncio.run(through_client())


def test_an_over_long_prompt_is_a_400_context_length_error(server: SpanqServe):
    query = generate(user("word " * 6000), max_tokens=2)
    answer = httpx.post(f"{server.url}{EXECUTE}?stream=true", json=to_json(query), timeout=60)
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "ContextLengthError"

    async def through_client():
        async with SpanBackend(server.url) as backend:
            await backend.generate(query)

    with pytest.raises(ContextLengthError):
        asyncio.run(through_client())


def test_an_absurdly_long_prompt_is_refused_without_holding_up_other_requests(server: SpanqServe):
    """A body near the size limit (8 MiB of text: seconds of tokenizing) is a 400 context-length error, and the
    server answers other requests meanwhile: the tokenizing runs off the event loop. Before, every request —
    /health included — waited for it."""
    import threading

    text = "The quick brown fox jumps over the lazy dog near the old town hall. " * 110_000  # 7.6 MB
    refused: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: refused.append(
        httpx.post(f"{server.url}{EXECUTE}", json=to_json(generate(user(text), max_tokens=2)), timeout=120)))
    sender.start()
    try:
        time.sleep(1.5)  # the body is in and being tokenized (~1 s to upload and parse here)
        waits = []
        while sender.is_alive() and len(waits) < 20:
            started = time.monotonic()
            _assert_healthy(server)
            waits.append(time.monotonic() - started)
            time.sleep(0.1)
    finally:
        sender.join()
    assert refused[0].status_code == 400 and refused[0].json()["error"]["type"] == "ContextLengthError", refused[0].text
    assert waits, "the long prompt was refused before it could be seen running: make it longer"
    assert max(waits) < 1.0, f"other requests waited {max(waits):.1f} s behind the long prompt's tokenizing"


def test_concurrent_queries_needing_the_same_fragments_at_other_positions_all_finish(server: SpanqServe):
    orders = ("CABD", "DBCA", "BDAC", "ACDB")

    async def scenario():
        async with SpanBackend(server.url) as backend:
            return await asyncio.gather(*(backend.generate(rag_query(o)) for o in orders))

    completions = asyncio.run(asyncio.wait_for(scenario(), timeout=300))
    for c in completions:
        assert c.metrics.cached_tokens > 0 and c.metrics.generated_tokens == 6


def _wait_until_idle(url: str, idle_usage: float) -> None:
    deadline = time.monotonic() + 30
    while (_gauge(url, "num_requests_running"), _gauge(url, "kv_cache_usage_perc")) != (0, idle_usage):
        assert time.monotonic() < deadline, "the aborted request still holds the engine's blocks"
        time.sleep(0.5)


LONG_RUN = generate(
    cross(
        system("Write a long story."), plus(fragment("alpha " * 120), fragment("beta " * 120)), user("Go.")
    ),
    max_tokens=3000,
    temperature=0.0,
)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server: SpanqServe):
    idle_usage = _gauge(server.url, "kv_cache_usage_perc")
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{server.url}{EXECUTE}?stream=true", json=to_json(LONG_RUN)) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()  # keep a reference: dropping the iterator closes the connection
        first = next(lines)
        assert json.loads(first.removeprefix("data: "))["object"] == "chat.completion.chunk"
        deadline = time.monotonic() + 10  # the gauges follow the engine's stats, a step or so behind
        while _gauge(server.url, "num_requests_running") < 1:
            assert time.monotonic() < deadline, "the running request never showed in /metrics"
            time.sleep(0.2)
    _wait_until_idle(server.url, idle_usage)  # closing the stream aborted the engine requests
    answer = httpx.post(f"{server.url}{EXECUTE}", json=to_json(rag_query("ABCD", max_tokens=2)), timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


def test_a_client_that_gives_up_on_a_plain_request_frees_its_blocks(server: SpanqServe):
    idle_usage = _gauge(server.url, "kv_cache_usage_perc")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{EXECUTE}", json=to_json(LONG_RUN), timeout=httpx.Timeout(60, read=2))
    _wait_until_idle(server.url, idle_usage)
    answer = httpx.post(f"{server.url}{EXECUTE}", json=to_json(rag_query("DCBA", max_tokens=2)), timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


# --------------------------------------------------------------------------------------------- hostile input


def _post_raw(server: SpanqServe, body: bytes | str) -> httpx.Response:
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    return httpx.post(f"{server.url}{EXECUTE}", content=data, headers={"content-type": "application/json"},
                      timeout=120)


def _assert_healthy(server: SpanqServe) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_queries_over_a_limit_are_400s_naming_the_limit_and_the_server_stays_up(server: SpanqServe):
    deep = '{"user":"x"}'
    for _ in range(10_000):
        deep = '{"plus":[' + deep + "]}"
    cases = {
        "max_n": '{"g":{"max_tokens":8,"temperature":0,"n":1000000000,"input":{"user":"hi"}}}',
        "max_bulk": '{"repeat":{"n":500000,"g":{"input":{"user":"hi"},"max_tokens":1}}}',  # (over 10^6: as read)
        "max_depth": deep,
        "max_calls": '{"repeat":{"n":200,"g":{"input":{"user":"hi"},"max_tokens":1}}}',  # this server: 64
        "max_body_bytes": '{"user":"' + "x" * (9 << 20) + '"}',
    }
    rss = server.rss_bytes()
    started = time.monotonic()
    for limit, body in cases.items():
        answer = _post_raw(server, body)
        assert answer.status_code == 400, (limit, answer.status_code, answer.text[:300])
        message = answer.json()["error"]["message"]
        assert limit in message and "spanq serve --" in message, message
        _assert_healthy(server)
    assert time.monotonic() - started < 60, "refusing must not run anything"
    assert server.rss_bytes() < rss + (512 << 20), "refused queries must not grow the server"


def test_a_retrieve_sent_to_the_server_is_refused_by_its_path_with_what_an_http_client_can_do(server: SpanqServe):
    """The server has no retriever: the 400 names the node and says to send the documents as fragments (it said
    "pass retrievers={'default': fn} to optimize()", advice for Python, with no path)."""
    doc = {"g": {"model": "", "input": {"cross": [{"user": "hi"}, {"retrieve": {"query": "x"}}]}, "max_tokens": 2}}
    answer = _post_raw(server, json.dumps(doc))
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == ("$.g.input.cross[1].retrieve: this server has no retriever: "
                                                 "retrieve the documents first and send them as fragments of a plus")
    _assert_healthy(server)


def test_a_body_that_is_a_json_string_is_refused_as_a_string(server: SpanqServe):
    """A body that is JSON text of a string ('"hello"', or a query encoded twice) is a 400 saying it got a string:
    the string was read as JSON again ("invalid JSON at line 1 column 1" for valid JSON; a query encoded twice
    ran)."""
    query = {"g": {"model": "", "input": {"user": "hi"}, "max_tokens": 1}}
    for body in ('"hello"', json.dumps(json.dumps(query))):
        answer = _post_raw(server, body)
        assert answer.status_code == 400, body
        assert answer.json()["error"]["message"].startswith("$: expected a query node (a JSON object), got a string")
    _assert_healthy(server)


def test_a_body_over_the_size_limit_is_refused_with_its_size(server: SpanqServe):
    """The refusal names how large the body is: its declared length, or (sent in chunks, no length declared) how
    much had arrived when reading stopped. It said "the body is larger than that" either way."""
    body = ('{"user":"' + "x" * (9 << 20) + '"}').encode()
    declared = _post_raw(server, body)
    assert declared.status_code == 400
    assert declared.json()["error"]["message"].startswith(f"$: the body is {len(body)} bytes, over the server's "
                                                          "limit max_body_bytes=")  # fmt: skip

    def chunks():
        for at in range(0, len(body), 1 << 20):
            yield body[at:at + (1 << 20)]

    sent = httpx.post(f"{server.url}{EXECUTE}", content=chunks(), headers={"content-type": "application/json"},
                      timeout=120)  # fmt: skip
    assert sent.status_code == 400
    message = sent.json()["error"]["message"]
    stopped = re.match(r"\$: the body is at least (\d+) bytes \(reading stopped there\), over the server's limit "
                       r"max_body_bytes=(\d+) ", message)  # fmt: skip
    assert stopped and int(stopped[2]) < int(stopped[1]) <= len(body), message
    _assert_healthy(server)


def test_spanq_serve_says_when_it_is_ready_and_what_a_query_prepares(server: SpanqServe):
    """The server's log shows spanq's progress as the embedded engine's does (README, "Logs"): a line as it starts
    (on a CPU, saying it runs eager and what compiling would buy), one when its engine is up with the address it serves on, and one for a query's new documents. It showed only the
    model's family (vLLM's own INFO lines, its "ready" among them, are off by default)."""
    log = server.log.read_text("utf-8", "replace")
    assert re.search(r"^spanq: starting a span-aware vLLM server on \S+", log, re.MULTILINE), log[-3000:]
    # eager on a CPU (spanq's default there), and how to compile instead: vLLM's own line about it is dropped
    assert re.search(r"^spanq: starting .*\(eager, to start in seconds: --no-enforce-eager compiles", log, re.MULTILINE)
    assert re.search(r"^spanq: \S+ ready in \d+\.\d s; the HTTP server starts on http://\S+:\d+ ", log, re.MULTILINE), log[-3000:]
    logged = server.log.stat().st_size
    fresh = {c: f"Logbook {c} {time.time_ns()}. " + DOCS[c] for c in "AB"}
    answer = httpx.post(f"{server.url}{EXECUTE}", json=to_json(rag_query("AB", max_tokens=2, docs=fresh)), timeout=60)
    assert answer.status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(server.log, "rb") as f:
            f.seek(logged)
            written = f.read().decode("utf-8", "replace")
        if "new documents" in written:
            break
        time.sleep(0.1)
    assert "spanq: read 2 new documents in context for the query; preparing them as spans when idle" in written


def test_a_client_gone_during_its_upload_is_no_server_error(server: SpanqServe):
    """A client that sends half its body and closes the connection is not the server's failure: no 500 and no
    traceback in the log (an operator paged for a client's hang-up learns nothing), and the server answers on."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(server.url)
    logged = server.log.stat().st_size
    for _ in range(3):
        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            sock.sendall(
                f"POST {EXECUTE} HTTP/1.1\r\nHost: {url.hostname}\r\ncontent-type: application/json\r\n"
                "content-length: 100000\r\n\r\n".encode() + b'{"user": "' + b"x" * 1000
            )
            time.sleep(0.3)  # the handler is reading the body when the client goes
    time.sleep(1.0)
    _assert_healthy(server)
    answer = httpx.post(f"{server.url}{EXECUTE}", json=to_json(rag_query("BADC", max_tokens=2)), timeout=60)
    assert answer.status_code == 200
    with open(server.log, "rb") as f:
        f.seek(logged)
        written = f.read().decode("utf-8", "replace")
    assert "Traceback" not in written and " 500" not in written, written[-3000:]


def test_values_the_engine_would_refuse_are_400s_naming_the_path(server: SpanqServe):
    cases = {
        '{"g":{"max_tokens":2,"temperature":1e308,"input":{"user":"hi"}}}': "$.g.temperature",
        '{"g":{"max_tokens":2,"seed":1208925819614629174706176,"input":{"user":"hi"}}}': "$.g.seed",
        '{"g":{"max_tokens":2,"input":{"user":"\\ud800"}}}': "$.g.input.user",
        '{"g":{"max_tokens":10000000,"input":{"user":"hi"}}}': "$.g.max_tokens",  # over the window whatever the prompt
        '{"g":{"max_tokens":2,"input":{"cross":[{"user":"hi"},{"g":{"max_tokens":10000000,"input":{"user":"x"}}}]}}}':
            "$.g.input.cross[1].g.max_tokens",
        '{"g":{"max_tokens":' + "9" * 5000 + ',"input":{"user":"hi"}}}': "$: the request body is not JSON (a number",
    }
    for body, path in cases.items():
        answer = _post_raw(server, body)
        assert answer.status_code == 400, (body[:100], answer.status_code, answer.text[:300])
        assert answer.json()["error"]["message"].startswith(path), answer.text
        assert "set_int_max_str_digits" not in answer.text, "the client was told to raise the server's limit"
    _assert_healthy(server)


# Random documents: mostly malformed, some small valid queries (one token each), some valid ones broken in one
# place. Only 200 and 4xx may come back, and the server keeps answering.
_small_queries = st.builds(
    lambda text, n, order: {"g": {"max_tokens": 1, "temperature": 0, "n": n, "input": {"cross": [
        {"system": "Notes."}, {"plus": [{"fragment": DOCS[c]} for c in order]}, {"user": text}]}}},
    st.text(max_size=10), st.integers(1, 2), st.sampled_from(["AB", "BA", "C"]),
)
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["g", "plus", "cross", "user", "input", "n", "max_tokens", "repeat", "fragment", "model"])
        | st.text(max_size=3), inner, max_size=3),
    max_leaves=12,
)


def _broken(doc: dict, data: st.DataObject) -> dict:
    body = dict(doc["g"])
    key = data.draw(st.sampled_from(["max_tokens", "temperature", "n", "input", "seed", "stop", "model"]))
    body[key] = data.draw(_values)
    return {"g": body}


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_queries_get_200_or_4xx_and_the_server_stays_up(server: SpanqServe, data):
    kind = data.draw(st.sampled_from(["random", "valid", "broken"]))
    doc = data.draw(_values) if kind == "random" else data.draw(_small_queries)
    if kind == "broken":
        doc = _broken(doc, data)
    answer = httpx.post(f"{server.url}{EXECUTE}", json=doc, timeout=120)
    assert answer.status_code == 200 or 400 <= answer.status_code < 500, (doc, answer.status_code, answer.text[:300])
    if answer.status_code != 200:
        assert "InternalServerError" not in answer.text
    _assert_healthy(server)


def test_a_json_schema_constrains_the_answer_through_the_query_route(server: SpanqServe):
    """`Generate.json_schema` travels in the query's JSON and spanq serve decodes under it (a random model, so only
    the form is checked: JSON of the schema, with its spans still reused)."""
    from spanq_integrations.runtime.executor import execute

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"]}
    docs = [fragment(f"Shelf {c} holds {i} boxes of tea.") for i, c in enumerate("XYZ")]
    ask = lambda order: generate(
        cross(system("Answer in JSON."), plus(*[docs[i] for i in order]), user("How many boxes?")),
        json_schema=schema, max_tokens=20, temperature=0)
    backend = SpanBackend(server.url)
    try:
        first = execute(ask([0, 1, 2]), backend)
        second = execute(ask([2, 0, 1]), backend)
    finally:
        asyncio.run(backend.aclose())
    for result in (first, second):
        answer = json.loads(result.answer)
        assert set(answer) == {"n"} and 0 <= answer["n"] <= 99
    assert second.calls[-1].prepared_spans == 0
