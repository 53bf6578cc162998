"""spnl's own package (spnl 0.22.1 from PyPI: its Rust serde types behind pyo3) as the reference for what spanq
writes: every query made of spnl's nodes that spanq writes is one spnl's parser accepts, and the forms spnl refuses
are refused by the package itself, not by a model of it written here.

`spnl.execute(json)` parses the query with spnl's own `Query` type, then runs it. A parse failure is reported as
"Error in deserialization …"; anything after parsing (here: calls naming a model no provider of spnl serves, which
never reach a network) fails otherwise. So "spnl accepts this" reads: `execute` fails for any reason but
deserialization.

spnl's executor against an OpenAI-compatible server: a recording server here takes its requests, and for the
shapes both read alike (a `g` over messages, a conversation, a `repeat`) spnl sends the messages and settings
spanq's own OpenAI client sends; where they read a query differently (a `plus` of messages, a `map`) the requests
differ, as docs/design.md ("spnl compatibility") says. That its answers over `spanq serve`'s OpenAI route are
spanq's own executor's is checked in `tests/backend/test_server.py` (it needs the server).

What the package cannot check stays with the hand-written reader (`tests/integrations/spnl_reader.py`): the
`print` node (the PyPI build has none: its parser refuses it, shown below) and the wire format of spanq's
`/v1/query/execute`, which spnl's PyPI build has no client for.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import spnl  # the dev extra pins spnl 0.22.1
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spanq_integrations.backends.openai import OpenAIBackend
from spanq_integrations.query.flatten import to_chat_messages
from spanq_integrations.query.ir import (
    Assistant,
    Generate,
    Map,
    Node,
    Plus,
    Repeat,
    User,
    cross,
    fragment,
    generate,
    plus,
    system,
    user,
)
from spanq_integrations.query.spnl_json import from_json, to_json
from tests.strategies import spnl_core_queries

DESERIALIZATION = "Error in deserialization"
# Model names no provider of spnl's serves ("openai/…", "ollama/…", "spnl/…" would be sent somewhere): execution
# stops at "Model not found", after the parse, without a network.
LOCAL_MODELS = st.sampled_from(["m", "tiny", ""])


def spnl_parse_error(doc: Any) -> str | None:
    """spnl's own parser's complaint about `doc`, or None where it parses it."""

    async def run() -> str | None:
        try:
            await spnl.execute(json.dumps(doc))
        except Exception as e:  # noqa: BLE001 - spnl raises OSError for parse and run failures alike
            return str(e) if DESERIALIZATION in str(e) else None
        return None

    return asyncio.run(run())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spnl_core_queries(print_node=False, models=LOCAL_MODELS))
def test_spnls_parser_accepts_every_query_of_its_nodes_that_spanq_writes(query: Node) -> None:
    doc = to_json(query)
    assert spnl_parse_error(doc) is None, (doc, spnl_parse_error(doc))
    assert from_json(doc) == query


def test_spnl_parses_an_empty_join_as_spanq_writes_it() -> None:
    """A RAG template whose retriever found nothing: spnl reads its empty `plus`, and so does spanq now."""
    doc = to_json(Generate(input=cross(system("s"), Plus(children=()), user("q")), model="m"))
    assert doc["g"]["input"]["cross"][1] == {"plus": []}
    assert spnl_parse_error(doc) is None and from_json(doc) == from_json(json.loads(json.dumps(doc)))


def test_the_check_fails_on_forms_spnl_refuses() -> None:
    """What spnl's parser refuses it refuses here: the `repeat` form spanq wrote before 0.22 (`query` for `g`), a
    node with two keys, a `g` without a model — so the property above can fail."""
    g = to_json(Generate(input=User(text="x"), model="m"))
    assert spnl_parse_error({"repeat": {"n": 2, "g": g["g"]}}) is None
    assert DESERIALIZATION in spnl_parse_error({"repeat": {"n": 2, "query": g}})
    assert DESERIALIZATION in spnl_parse_error({"user": "a", "system": "b"})
    assert DESERIALIZATION in spnl_parse_error({"g": {"input": {"user": "x"}}})


def test_spanqs_extensions_are_ones_spnl_refuses_and_written_only_when_used() -> None:
    """spanq's own keys (a `plus` group's anchor or role, a fragment) are extensions spnl's parser does not read: a query
    that uses none of them is written without them, so spnl reads it; one that uses them is not spnl's."""
    docs = [fragment("Doc A."), fragment("Doc B.")]
    plain = to_json(generate(cross(system("s"), plus(*[user(d.text) for d in docs]), user("q")), model="m"))
    assert spnl_parse_error(plain) is None
    anchored = to_json(generate(cross(system("s"), plus(*docs, anchor="prefix"), user("q")), model="m"))
    assert DESERIALIZATION in spnl_parse_error(anchored)
    in_system = to_json(generate(cross(system("s"), plus(*[user(d.text) for d in docs], role="system")), model="m"))
    assert DESERIALIZATION in spnl_parse_error(in_system)


def test_the_pypi_build_has_no_print_node() -> None:
    """Why the hand-written reader keeps `print`: spnl's PyPI build refuses it, where spnl's sources have it."""
    assert DESERIALIZATION in spnl_parse_error({"print": "hello"})
    assert spnl_parse_error({"user": "hello"}) is None


# ------------------------------------------------------------------------------------------ what spnl sends


@pytest.fixture(scope="module")
def recorder(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """An OpenAI-compatible server that records requests (`openai_recorder.py`, in a process of its own): its
    base URL and its log."""
    log = tmp_path_factory.mktemp("recorder") / "requests.jsonl"
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("openai_recorder.py")), str(log)],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}/v1", log
    finally:
        proc.kill()
        proc.wait()


def spnl_requests(recorder: tuple[str, Path], query: Node, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """The requests (path, body) spnl's executor sends for the query spanq wrote."""
    url, log = recorder
    monkeypatch.setenv("OPENAI_API_BASE", url)
    log.write_text("")
    asyncio.run(spnl.execute(json.dumps(to_json(query))))
    return [tuple(json.loads(line)) for line in log.read_text().splitlines()]


def spanqs_body(call: Generate) -> dict[str, Any]:
    """What spanq's OpenAI client sends for `call` (`OpenAIBackend.request_body`)."""
    return OpenAIBackend("http://unused").request_body(call, "m", to_chat_messages(call.input))


MODEL = "openai/m"
SAME_SHAPES = {
    "a user message": generate(user("Name a town."), model=MODEL, max_tokens=7, temperature=0.0),
    "system, then user": generate(cross(system("Be terse."), user("Which door?")), model=MODEL, max_tokens=5),
    "a conversation": generate(
        cross(system("Answer briefly."), user("A colour?"), Assistant(text="Blue."), user("Another?")),
        model=MODEL, max_tokens=9, temperature=1.0,
    ),
}


@pytest.mark.parametrize("shape", sorted(SAME_SHAPES))
def test_spnl_sends_the_messages_and_settings_spanq_sends(recorder, monkeypatch, shape):
    call = SAME_SHAPES[shape]
    ((path, body),) = spnl_requests(recorder, call, monkeypatch)
    ours = spanqs_body(call)
    assert path.endswith("/chat/completions")
    assert body["messages"] == ours["messages"]
    assert body["temperature"] == ours["temperature"]
    assert body["max_completion_tokens"] == ours["max_tokens"]  # the same limit, OpenAI's newer name


def test_a_repeat_is_one_request_for_n_choices_in_spnl(recorder, monkeypatch):
    call = generate(cross(system("s"), user("q")), model=MODEL, max_tokens=4, temperature=0.6)
    ((_, body),) = spnl_requests(recorder, Repeat(n=3, query=call), monkeypatch)
    assert body["n"] == 3 and body["messages"] == spanqs_body(call)["messages"]


def test_where_spnl_reads_a_query_otherwise_the_requests_differ(recorder, monkeypatch):
    """The two known differences, shown on the requests (so the message check above can fail): spanq joins
    consecutive messages of one role — a `plus` of messages, or a message after it — into one turn, its parts
    separated by a blank line, where spnl sends each message; and spnl completes a `map`'s inputs raw
    (`/v1/completions`), where spanq sends each as a user message."""
    call = generate(cross(system("s"), plus(user("Doc one."), user("Doc two.")), user("q")), model=MODEL, max_tokens=3)
    ((_, body),) = spnl_requests(recorder, call, monkeypatch)
    assert [m["content"] for m in body["messages"]] == ["s", "Doc one.", "Doc two.", "q"]
    assert [m["content"] for m in spanqs_body(call)["messages"]] == ["s", "Doc one.\n\nDoc two.\n\nq"]

    requests = spnl_requests(recorder, Map(inputs=("Say a", "Say b"), model=MODEL, max_tokens=2), monkeypatch)
    assert {path.rsplit("/", 2)[-1] for path, _ in requests} == {"completions"}
    assert not any(path.endswith("/chat/completions") for path, _ in requests)
    assert [spanqs_body(g)["messages"] for g in Map(inputs=("Say a",), model=MODEL).expand()] == [
        [{"role": "user", "content": "Say a"}]
    ]
