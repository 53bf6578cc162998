"""spnl JSON: lossless round trips, spnl's own documents loading unchanged, and errors that name the JSON path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings

from spanq_integrations.query.errors import QueryParseError, QueryValidationError
from spanq_integrations.query.ir import (
    Assistant,
    Chat,
    Cross,
    Fragment,
    Generate,
    Map,
    Monad,
    Node,
    Plus,
    Print,
    Repeat,
    Retrieve,
    System,
    User,
    cross,
    generate,
    plus,
    system,
    user,
)
from spanq_integrations.query.spnl_json import dumps, from_json, load_file, loads, to_json
from tests.integrations.spnl_reader import SpnlRejects, spnl_reads
from tests.strategies import span_queries, spnl_core_queries

DATA = Path(__file__).parent / "data"


# ------------------------------------------------------------------------------------------------ round trip


@settings(max_examples=300, deadline=None)
@given(span_queries())
def test_round_trip_is_lossless(query: Node) -> None:
    assert from_json(to_json(query)) == query
    assert loads(dumps(query)) == query
    assert loads(dumps(query, indent=None)) == query


@settings(max_examples=300, deadline=None)
@given(spnl_core_queries())
def test_spnl_0_22_reads_what_is_written(query: Node) -> None:
    """Every query made of spnl's own nodes is written in a form spnl 0.22's parser accepts."""
    spnl_reads(to_json(query))
    assert from_json(to_json(query)) == query


def test_the_older_repeat_form_is_one_spnl_0_22_rejects() -> None:
    """The reader above is strict where spnl is: the form spanq used to write fails it."""
    g = to_json(Generate(input=User(text="x"), model="m"))
    with pytest.raises(SpnlRejects, match=r"\$\.repeat: missing field 'g'"):
        spnl_reads({"repeat": {"n": 2, "query": g}})
    spnl_reads({"repeat": {"n": 2, "g": g["g"]}})


def test_written_form_uses_spnl_keys() -> None:
    q = generate(
        cross(system("judge"), plus(generate("a"), generate("b")), user("pick")),
        model="ollama/m",
        max_tokens=9,
    )
    assert to_json(q) == {
        "g": {
            "model": "ollama/m",
            "max_tokens": 9,
            "temperature": 0.6,
            "input": {
                "cross": [
                    {"system": "judge"},
                    {
                        "plus": [
                            {"g": {"model": "", "max_tokens": 0, "temperature": 0.6, "input": {"user": "a"}}},
                            {"g": {"model": "", "max_tokens": 0, "temperature": 0.6, "input": {"user": "b"}}},
                        ]
                    },
                    {"user": "pick"},
                ]
            },
        }
    }


def test_extra_generate_fields_are_written_only_when_set() -> None:
    g = Generate(input=User(text="x"), n=2, stop=("\n",), seed=7)
    assert to_json(g)["g"] == {
        "model": "",
        "max_tokens": 0,
        "temperature": 0.6,
        "n": 2,
        "stop": ["\n"],
        "seed": 7,
        "input": {"user": "x"},
    }


def test_spanq_nodes_are_written_in_spnl_style() -> None:
    source = Generate(input=User(text="q"), model="m")
    assert to_json(Assistant(text="a", source=source)) == {
        "assistant": {"text": "a", "source": to_json(source)}
    }
    assert to_json(Fragment(text="t")) == {"fragment": "t"}
    assert to_json(Fragment(text="t", id="d1", metadata={"page": 3})) == {
        "fragment": {"text": "t", "id": "d1", "metadata": {"page": 3}}
    }
    assert to_json(Retrieve(query="q")) == {"retrieve": {"query": "q", "k": 4, "retriever": "default"}}
    assert to_json(Repeat(n=2, query=source)) == {"repeat": {"n": 2, "g": to_json(source)["g"]}}
    assert to_json(Map(inputs=("a",), model="m")) == {
        "map": {"metadata": {"model": "m", "max_tokens": 0, "temperature": 0.6}, "inputs": ["a"]}
    }
    assert to_json(Chat(messages=(User(text="hi"),))) == {
        "chat": {"model": "", "max_tokens": 0, "temperature": 0.6, "messages": [{"user": "hi"}]}
    }


def test_a_group_s_anchor_and_role_are_sibling_keys_of_the_join() -> None:
    group = plus("a", "b", anchor="prefix", role="system")
    assert to_json(group) == {"plus": [{"fragment": "a"}, {"fragment": "b"}], "anchor": "prefix", "role": "system"}
    assert from_json({"par": [{"user": "a"}], "role": "system"}) == Plus(
        children=(User(text="a"),), keyword="par", role="system"
    )
    assert from_json({"plus": [{"user": "a"}], "role": "user"}) == from_json({"plus": [{"user": "a"}]})  # one spelling
    assert to_json(plus("a", role="user")) == {"plus": [{"fragment": "a"}]}
    with pytest.raises(QueryParseError, match=r'\$\.role: unknown role "assistant" for a plus') as caught:
        from_json({"plus": [{"user": "a"}], "role": "assistant"})
    assert caught.value.path == "$.role"
    with pytest.raises(QueryParseError, match="exactly one key"):
        from_json({"plus": [{"user": "a"}], "role": "system", "colour": "red"})
    with pytest.raises(QueryValidationError, match="unknown role 'tool'"):
        plus("a", role="tool")  # type: ignore[arg-type]


def test_an_empty_join_is_written_and_read_back() -> None:
    """spnl parses `{"plus": []}` (a RAG template whose retriever found nothing: test_spnl_package.py); spanq refused to read or write it,
    though it runs: the empty group adds nothing. A call left with nothing to send is still refused, at its input."""
    from spanq_integrations import execute

    query = Generate(input=Cross(children=(User(text="a"), Plus(children=()))), model="m")
    doc = to_json(query)
    assert doc["g"]["input"] == {"cross": [{"user": "a"}, {"plus": []}]} and from_json(doc) == query
    assert plus(*[]) == Plus(children=())  # (a Python app's retriever that found nothing, too)
    with pytest.raises(QueryValidationError, match="nothing to send") as raised:
        execute(from_json({"g": {"model": "m", "input": {"plus": []}}}), "http://127.0.0.1:9")
    assert raised.value.path == "$.g.input"


# ------------------------------------------------------------------------------------------------ spnl forms


def test_spnl_defaults_apply_to_absent_settings() -> None:
    assert loads('{"g": {"model": "ollama/m", "input": {"user": "hi"}}}') == Generate(
        input=User(text="hi"), model="ollama/m", max_tokens=0, temperature=0.6
    )
    assert loads('{"g": {"input": {"user": "hi"}, "max_tokens": null, "temperature": null}}') == Generate(
        input=User(text="hi")
    )


def test_seq_and_par_keep_their_spelling() -> None:
    q = loads('{"par": [{"seq": [{"user": "a"}, {"assistant": "b"}]}, {"system": "c"}]}')
    assert q == Plus(
        keyword="par",
        children=(Cross(keyword="seq", children=(User(text="a"), Assistant(text="b"))), System(text="c")),
    )
    assert json.loads(dumps(q)) == {"par": [{"seq": [{"user": "a"}, {"assistant": "b"}]}, {"system": "c"}]}


@pytest.mark.parametrize(
    "repeat",
    [
        {"n": 3, "g": {"model": "m", "input": {"user": "x"}}},
        {"n": 3, "query": {"g": {"model": "m", "input": {"user": "x"}}}},
        {"n": 3, "generate": {"model": "m", "input": {"user": "x"}}},
    ],
    ids=["spnl-0.22", "older-spnl", "generate"],
)
def test_every_repeat_form_loads(repeat: dict[str, Any]) -> None:
    assert from_json({"repeat": repeat}) == Repeat(n=3, query=Generate(input=User(text="x"), model="m"))


def test_map_monad_print_load() -> None:
    doc = {
        "seq": [
            {"print": "hello"},
            {"monad": {"g": {"model": "m", "input": {"user": "warm"}, "max_tokens": 1}}},
            {"map": {"metadata": {"model": "m", "max_tokens": 5, "temperature": 0.0}, "inputs": ["a", "b"]}},
        ]
    }
    assert from_json(doc) == Cross(
        keyword="seq",
        children=(
            Print(text="hello"),
            Monad(query=Generate(input=User(text="warm"), model="m", max_tokens=1)),
            Map(inputs=("a", "b"), model="m", max_tokens=5, temperature=0.0),
        ),
    )


# zip: A before every item of B, as spnl's executor builds it (spnl-run's `intersperse`)


def test_zip_puts_first_before_each_item_of_the_second_join() -> None:
    doc = {"zip": {"first": {"system": "S"}, "second": {"cross": [{"user": "a"}, {"user": "b"}]}}}
    assert from_json(doc) == Cross(children=(System(text="S"), User(text="a"), System(text="S"), User(text="b")))
    doc = {"zip": {"first": {"user": "Q"}, "second": {"par": [{"fragment": "d1"}, {"fragment": "d2"}]}}}
    assert from_json(doc) == Plus(
        keyword="par", children=(User(text="Q"), Fragment(text="d1"), User(text="Q"), Fragment(text="d2"))
    )


def test_zip_with_a_plus_first_joins_each_item_into_the_group() -> None:
    doc = {
        "zip": {
            "first": {"plus": [{"fragment": "d1"}, {"fragment": "d2"}]},
            "second": {"seq": [{"user": "q1"}, {"user": "q2"}]},
        }
    }
    group = (Fragment(text="d1"), Fragment(text="d2"))
    assert from_json(doc) == Cross(
        keyword="seq",
        children=(Plus(children=(*group, User(text="q1"))), Plus(children=(*group, User(text="q2")))),
    )


def test_zip_into_a_message_or_a_g_is_first_then_it() -> None:
    assert from_json({"zip": {"first": {"system": "S"}, "second": {"user": "u"}}}) == Cross(
        keyword="seq", children=(System(text="S"), User(text="u"))
    )
    g = {"g": {"model": "m", "input": {"user": "q"}}}
    assert from_json({"zip": {"first": {"system": "S"}, "second": g}}) == Cross(
        keyword="seq", children=(System(text="S"), Generate(input=User(text="q"), model="m"))
    )


def test_zip_nests_and_its_expansion_round_trips() -> None:
    inner = {"zip": {"first": {"user": "b"}, "second": {"plus": [{"user": "x"}, {"user": "y"}]}}}
    q = from_json({"g": {"model": "m", "input": {"zip": {"first": {"system": "a"}, "second": inner}}}})
    b, a = User(text="b"), System(text="a")
    expected_input = Plus(children=(a, b, a, User(text="x"), a, b, a, User(text="y")))
    assert q == Generate(input=expected_input, model="m")
    assert from_json(to_json(q)) == q
    spnl_reads(to_json(q))


@pytest.mark.parametrize(
    "doc, message",
    [
        (
            {"zip": {"first": {"g": {"model": "m", "input": {"user": "q"}}}, "second": {"plus": [{"user": "a"}, {"user": "b"}]}}},
            "$.zip.first: a zip whose first part generates would run that generation once per item",
        ),
        (
            {"zip": {"first": {"user": "a"}, "second": {"repeat": {"n": 2, "g": {"model": "m", "input": {"user": "q"}}}}}},
            '$.zip.second: cannot zip into a "repeat"',
        ),
        ({"zip": {"first": {"user": "a"}}}, '$.zip: missing "second"'),
        ({"zip": {"first": {"user": "a"}, "second": {"user": "b"}, "third": {}}}, '$.zip: unknown field "third"'),
    ],
)
def test_zips_spanq_cannot_expand_faithfully_are_named(doc: Any, message: str) -> None:
    with pytest.raises(QueryParseError) as e:
        from_json(doc)
    assert str(e.value).startswith(message)


def test_a_document_that_expands_past_the_node_limit_is_refused_before_anything_walks_it() -> None:
    """Each zip stays under its own limit, but zips side by side under a seq add up: 200 zips of 14 levels each
    (0.2 MB of JSON) expanded to 13 million nodes, which every check after the parse then walked (~50 s)."""
    import time

    zipped: Any = {"user": "x"}
    for _ in range(14):  # each level puts the last before two items: twice its size (32,766 nodes; ~1 KB)
        zipped = {"zip": {"first": zipped, "second": {"cross": [{"user": "a"}, {"user": "b"}]}}}
    assert len(json.dumps(zipped)) < 2000
    started = time.monotonic()
    with pytest.raises(QueryParseError, match=r"^\$: the query expands to \d+ query nodes, over 65536"):
        from_json({"seq": [zipped] * 200})
    assert time.monotonic() - started < 10


def test_a_document_of_more_objects_than_any_query_holds_is_refused_before_it_is_read() -> None:
    """300,000 user messages in a seq (3.6 MB of JSON, under the body limit): refused while the JSON is looked
    over, before 300,000 nodes are built (and walked by every check after)."""
    from spanq_integrations.query.limits import QueryLimitError, check_json_depth

    with pytest.raises(QueryLimitError, match="objects and arrays"):
        check_json_depth({"seq": [{"user": "x"}] * 300_000})
    check_json_depth({"seq": [{"user": "x"}] * 50_000})  # a large but possible query passes


def test_a_map_without_inputs_is_refused_before_it_runs_where_it_says_so() -> None:
    """It would run nothing, and its answer — an empty plus — is no query a server can send back (that was a
    500 after the run)."""
    from spanq_integrations.query.limits import check_limits

    with pytest.raises(QueryValidationError, match=r"^\$\.map\.inputs: a map needs at least one input"):
        check_limits(from_json({"map": {"inputs": []}}))


def test_augment_is_refused_by_name() -> None:
    doc = {"augment": {"embedding_model": "ollama/e", "body": {"user": "q"}, "doc": ["a.txt", {"Text": "t"}]}}
    with pytest.raises(QueryParseError, match=r'^\$\.augment: "augment" \(spnl\'s optional rag feature.*"retrieve"'):
        from_json(doc)


def test_fragment_and_assistant_object_forms_load() -> None:
    doc = {
        "plus": [
            {"fragment": {"text": "t", "id": "d1", "metadata": {"src": "wiki"}}},
            {"assistant": {"text": "a", "source": {"g": {"model": "m", "input": {"user": "q"}}}}},
            {"assistant": {"text": "b"}},
        ]
    }
    assert from_json(doc) == Plus(
        children=(
            Fragment(text="t", id="d1", metadata={"src": "wiki"}),
            Assistant(text="a", source=Generate(input=User(text="q"), model="m")),
            Assistant(text="b"),
        )
    )


def test_from_json_accepts_text() -> None:
    assert from_json('{"user": "hi"}') == User(text="hi")


def test_spnl_token_query_loads() -> None:
    assert load_file(DATA / "tok_query.json") == Generate(
        input=User(text="hello"), model="ibm-granite/granite-3.3-2b-instruct"
    )


def test_spnl_email_judge_loads() -> None:
    q = load_file(DATA / "email.json")
    assert isinstance(q, Generate) and q.model == "ollama/granite3.2:2b"
    assert isinstance(q.input, Cross) and q.input.keyword == "seq"
    kinds = [type(c) for c in q.input.children]
    assert kinds == [System, Print, Plus, Print, User]
    (candidates,) = q.input.children[2].children
    assert candidates == Repeat(
        n=4,
        query=Generate(
            input=User(
                text="write an introductory email for a job application, limited to at most 100 characters."
            ),
            model="ollama/granite3.2:2b",
            max_tokens=100,
            temperature=0.5,
        ),
    )


def test_spnl_email_policy_judge_loads() -> None:
    q = load_file(DATA / "email3.json")
    assert isinstance(q, Generate) and isinstance(q.input, Cross) and q.input.keyword == "cross"
    repeat = q.input.children[2].children[0]
    assert isinstance(repeat, Repeat) and repeat.n == 4
    assert [type(c) for c in repeat.query.input.children] == [System, User]
    assert loads(dumps(q)) == q


# ------------------------------------------------------------------------------------------------ errors


def _error(doc: Any) -> QueryParseError:
    with pytest.raises(QueryParseError) as e:
        from_json(doc) if not isinstance(doc, str) else loads(doc)
    return e.value


def test_unknown_node_names_the_path_and_the_known_kinds() -> None:
    e = _error({"g": {"input": {"cross": [{"user": "a"}, {"user": "b"}, {"usr": "c"}]}}})
    assert e.path == "$.g.input.cross[2]"
    assert str(e).startswith(
        '$.g.input.cross[2]: unknown node "usr" (expected one of: assistant, chat, combine, cross,'
    )


def test_malformed_json_names_line_and_column() -> None:
    e = _error('{\n  "g": {\n    "input": {"user": "a"},,\n  }\n}')
    assert e.path == "$"
    assert str(e).startswith("$: invalid JSON at line 3 column 28: ")


def test_a_query_file_holding_a_json_string_is_refused_as_a_string_not_as_invalid_json() -> None:
    """A file whose JSON is a string is valid JSON, not a query: a plain string was refused as "invalid JSON", and
    a query encoded twice (a string holding a query's JSON) was read as the query — the server refuses both."""
    from spanq_integrations.query.spnl_json import loads

    for text in ('"hello"', json.dumps(json.dumps({"g": {"model": "", "input": {"user": "Hi"}}}))):
        with pytest.raises(QueryParseError) as e:
            loads(text)
        assert str(e.value).startswith("$: expected a query node (a JSON object), got a string"), text


def test_generate_without_input() -> None:
    e = _error({"g": {"model": "m"}})
    assert str(e) == '$.g: missing "input"'


def test_a_plus_of_its_own_role_or_anchor_inside_another_is_refused_where_it_is() -> None:
    """Its role and anchor were read as the outer group's, silently (its documents went into the user turn)."""
    inner = {"plus": [{"user": "a"}], "role": "system"}
    e = _error({"g": {"model": "m", "input": {"plus": [{"user": "b"}, inner]}}})
    assert e.path == "$.g.input.plus[1]" and "its own role 'system' cannot be honoured" in e.message
    e = _error({"g": {"model": "m", "input": {"plus": [{"plus": [{"user": "a"}], "anchor": "prefix"}], "role": "system"}}})
    assert e.path == "$.g.input.plus[0]" and "role 'user', anchor 'prefix'" in e.message
    # the same role and anchor, or none of its own, is one group
    assert from_json({"g": {"model": "m", "input": {"plus": [inner, {"user": "b"}], "role": "system"}}})
    assert from_json({"g": {"model": "m", "input": {"plus": [{"plus": [{"user": "a"}]}], "anchor": "prefix"}}})


def test_a_repeat_of_more_copies_than_spanq_expands_is_refused_where_it_says_so() -> None:
    e = _error({"repeat": {"n": 10**9, "g": {"model": "m", "input": {"user": "x"}}}})
    assert e.path == "$.repeat.n" and "less than or equal to 1000000" in e.message


@pytest.mark.parametrize("key", ["plus", "cross", "seq", "par"])
def test_empty_join(key: str) -> None:
    query = from_json({"g": {"model": "m", "input": {"cross": [{"user": "a"}, {key: []}]}}})
    assert query.input.children[1].children == () and query.input.children[1].tag == key


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"g": {"input": {"user": "a"}, "max_tokens": -1}}, "$.g.max_tokens: must be >= 0, got -1"),
        (
            {"g": {"input": {"user": "a"}, "max_tokens": 1.5}},
            "$.g.max_tokens: expected an integer, got number 1.5",
        ),
        (
            {"g": {"input": {"user": "a"}, "max_tokens": True}},
            "$.g.max_tokens: expected an integer, got boolean true",
        ),
        (
            {"g": {"input": {"user": "a"}, "temperature": "hot"}},
            '$.g.temperature: expected a number, got string "hot"',
        ),
        ({"g": {"input": {"user": "a"}, "temperature": -0.5}}, "$.g.temperature: must be >= 0, got -0.5"),
        ({"g": {"input": {"user": "a"}, "model": 3}}, "$.g.model: expected a string, got number 3"),
        ({"g": {"input": {"user": "a"}, "n": 0}}, "$.g.n: must be >= 1, got 0"),
        ({"g": {"input": {"user": "a"}, "stop": ["x", 1]}}, "$.g.stop[1]: expected a string, got number 1"),
        ({"plus": [{"user": 5}]}, "$.plus[0].user: expected a string, got number 5"),
        ({"repeat": {"n": 0, "g": {"input": {"user": "a"}}}}, "$.repeat.n: must be >= 1, got 0"),
        (
            {"repeat": {"n": 2, "query": {"g": {"input": {"user": "a"}, "max_tokens": -3}}}},
            "$.repeat.query.g.max_tokens: must be >= 0, got -3",
        ),
        ({"repeat": {"n": 2, "query": {"user": "a"}}}, '$.repeat.query: expected a "g" node, got "user"'),
        (
            {"map": {"metadata": {"model": "m", "max_tokens": -1}, "inputs": ["a"]}},
            "$.map.metadata.max_tokens: must be >= 0, got -1",
        ),
        ({"map": {"inputs": ["a", None]}}, "$.map.inputs[1]: expected a string, got null"),
        ({"g": {"input": {"user": "a"}, "stop": 5}}, "$.g.stop: expected an array, got number"),
        (  # (a limit the model checks: it pointed at $.map.temperature, which the JSON does not have)
            {"map": {"metadata": {"temperature": 5}, "inputs": ["a"]}},
            "$.map.metadata.temperature: Input should be less than or equal to 2",
        ),
        ({"retrieve": {"query": "q", "k": 0}}, "$.retrieve.k: must be >= 1, got 0"),
        ({"chat": {"messages": []}}, "$.chat.messages: a chat needs at least one message"),
        ({"fragment": {"text": "t", "metadata": []}}, "$.fragment.metadata: expected an object, got array"),
        (
            {"assistant": {"text": "a", "source": {"user": "q"}}},
            '$.assistant.source: expected a "g" or "combine" node, got "user"',
        ),
    ],
)
def test_bad_field_names_its_exact_path(doc: Any, message: str) -> None:
    assert str(_error(doc)) == message


def test_unknown_field_lists_the_known_ones() -> None:
    e = _error({"g": {"input": {"user": "a"}, "max_token": 5}})
    assert str(e) == (
        '$.g: unknown field "max_token" (expected: model, max_tokens, temperature, n, stop, seed, json_schema, recompute, '
        'cold_spans, input)'
    )


def test_repeat_needs_exactly_one_generate_form() -> None:
    e = _error({"repeat": {"n": 2, "g": {"input": {"user": "a"}}, "query": {"g": {"input": {"user": "a"}}}}})
    assert str(e) == '$.repeat: expected exactly one of "g", "query" or "generate" (got "g", "query")'


def test_node_with_two_keys() -> None:
    e = _error({"plus": [{"user": "a", "system": "b"}]})
    assert e.path == "$.plus[0]"
    assert "exactly one key" in e.message and '("user", "system")' in e.message


def test_node_that_is_not_an_object() -> None:
    e = _error('{"cross": ["just text"]}')
    assert e.path == "$.cross[0]"
    assert "got string" in e.message


def test_deep_nesting_is_a_parse_error() -> None:
    depth = 100_000
    e = _error('{"monad": ' * depth + '{"user": "x"}' + "}" * depth)
    assert e.path == "$"


def test_validation_errors_never_escape() -> None:
    # every field is checked before the node is built; whatever slips through still names its path
    for doc in ({"g": {"input": {"user": "a"}, "seed": "x"}}, {"retrieve": {"query": 1}}, {"print": None}):
        assert isinstance(_error(doc), QueryParseError)


def test_a_json_schema_round_trips_and_a_malformed_one_is_named():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    g = generate(user("count"), json_schema=schema)
    assert list(g.schema["properties"]) == ["b", "a"], "property order is what the model writes: kept"
    assert from_json(to_json(g)) == g
    assert to_json(g)["g"]["json_schema"] == schema
    with pytest.raises(QueryParseError, match=r"\$\.g\.json_schema: expected a JSON schema"):
        from_json({"g": {"input": {"user": "x"}, "json_schema": [1]}})


def test_the_top_level_package_reads_writes_optimizes_and_names_usage() -> None:
    """What a user imports first: spnl JSON, the optimizer and the usage record from `spanq_integrations` itself,
    the same objects as the submodules' (no second copy to drift)."""
    import spanq_integrations as spanq
    from spanq_integrations.backends.protocol import Usage
    from spanq_integrations.optimizer import optimize

    query = spanq.generate(spanq.cross(spanq.plus(spanq.fragment("a"), spanq.fragment("b")), spanq.user("q")))
    assert spanq.loads(spanq.dumps(query)) == query == spanq.from_json(spanq.to_json(query))
    assert (spanq.optimize, spanq.Usage, spanq.load_file) == (optimize, Usage, load_file)
    assert {"loads", "dumps", "load_file", "optimize", "Usage"} <= set(spanq.__all__)


def test_cold_spans_is_written_only_when_set_and_a_bad_value_is_named() -> None:
    from spanq_integrations import fragment, generate, plus, user

    q = generate(plus(fragment("a"), fragment("b")), cold_spans="isolate")
    assert to_json(q)["g"]["cold_spans"] == "isolate" and loads(dumps(q)) == q
    assert "cold_spans" not in to_json(generate(user("x")))["g"]
    bad = to_json(q)
    bad["g"]["cold_spans"] = "later"
    with pytest.raises(QueryParseError, match=r"\$\.g\.cold_spans.*'auto', 'context', 'isolate'.*later"):
        from_json(bad)


def test_recompute_none_reads_as_zero_in_json_and_in_python_as_on_the_command_line():
    """`spanq serve --recompute none` is accepted; the same word in a query was a 400 listing only the names."""
    doc = {"g": {"model": "", "input": {"user": "hi"}, "recompute": "none"}}
    assert from_json(doc).recompute == 0.0
    assert generate("hi", recompute="none").recompute == 0.0
    assert to_json(from_json(doc))["g"]["recompute"] == 0.0
    with pytest.raises(QueryParseError, match=r"'none' or one of \['first'"):
        from_json({"g": {"model": "", "input": {"user": "hi"}, "recompute": "nothing"}})


def test_a_stop_string_reads_as_one_stop_as_openais_api_takes_it() -> None:
    """`"stop": "END"` was a 400 ("expected an array"); the Python builder takes a string as one stop too."""
    from spanq_integrations.query.ir import generate

    read = from_json({"g": {"input": {"user": "a"}, "stop": "END"}})
    assert read.stop == ("END",) and read == generate("a", stop="END", temperature=read.temperature)
