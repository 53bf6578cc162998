"""The IR declares each node's sub-queries once (`CHILD_FIELD`); every walk reads that declaration.

What a user sees of it: the path an error names (a limit, a failed call, a malformed document) is the path of
that node in the query's own JSON, whichever walk found it; a tree rebuilt with its own children is the same
object; every node kind is written, run and rendered."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings

from spanq_integrations.query import ir, spnl_json
from spanq_integrations.query.errors import QueryParseError, QueryValidationError
from spanq_integrations.query.ir import (
    NODE_TYPES,
    Cross,
    Generate,
    Node,
    Repeat,
    child_paths,
    children_of,
    cross,
    generate,
    plus,
    render,
    walk,
    with_children,
)
from spanq_integrations.query.limits import QueryLimits, check_limits
from spanq_integrations.query.spnl_json import to_json
from spanq_integrations.runtime import executor
from spanq_integrations.runtime.judge import judge_query
from tests.strategies import span_queries

NOWHERE = object()


def _at(doc: Any, path: str) -> Any:
    """The value at a JSON-style path (`$.g.input.cross[1]`) of a JSON document; NOWHERE if it has none."""
    value = doc
    for part in path.removeprefix("$").replace("[", ".[").split("."):
        if not part:
            continue
        try:
            value = value[int(part[1:-1])] if part.startswith("[") else value[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return NOWHERE
    return value


def path_mismatches(query: Node) -> list[str]:
    """The nodes `walk` names by a path under which the query's JSON holds something else. A generate under a
    `repeat` is the one node spnl writes as a bare body (`{"repeat": {"n", "g": {...}}}`): its body is checked."""
    doc = to_json(query)
    wrong = []
    for path, node in walk(query):
        found = _at(doc, path)
        if isinstance(node, Generate) and path.endswith(".repeat") and found is not NOWHERE:
            found = {"g": found["g"]}
        if found != to_json(node):
            wrong.append(path)
    return wrong


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(span_queries())
def test_every_path_walk_names_is_where_the_json_holds_that_node(query):
    assert path_mismatches(query) == []


def test_a_declaration_spelled_unlike_the_json_is_caught(monkeypatch):
    query = generate(cross("q", plus("a", "b")))
    assert path_mismatches(query) == []
    monkeypatch.setattr(Cross, "CHILD_FIELD", ("children", "children"))  # `$.cross.children[0]`: not the JSON's
    assert path_mismatches(query)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(span_queries())
def test_a_node_rebuilt_with_its_own_children_is_itself(query):
    for _, node in walk(query):
        assert with_children(node, children_of(node)) is node
        changed = [c.model_copy() for c in children_of(node)]
        if changed:
            rebuilt = with_children(node, changed)
            assert rebuilt == node and rebuilt is not node and all(
                a is b for a, b in zip(children_of(rebuilt), changed, strict=True)
            )


def test_with_children_refuses_a_count_its_node_cannot_hold():
    g = generate("hi")
    with pytest.raises(ValueError, match="exactly one child"):
        with_children(g, [])
    with pytest.raises(ValueError, match="has no children"):
        with_children(ir.User(text="x"), [ir.User(text="y")])


def test_the_node_types_are_the_members_of_node():
    (union, _) = typing.get_args(Node)
    assert set(NODE_TYPES) == set(typing.get_args(union))


@pytest.mark.parametrize("table", [spnl_json._WRITERS, executor._EVALUATORS], ids=["writer", "executor"])
def test_every_node_class_is_written_and_run(table):
    assert set(table) == set(NODE_TYPES)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(span_queries())
@example(ir.Fragment(text="", id="\n"))  # an id with a line break once rendered over two lines
def test_every_node_renders_with_a_label_of_its_own(query):
    lines = render(query).split("\n")
    assert len(lines) == sum(1 for _ in walk(query))
    assert not any(line.lstrip("│├└─ ").startswith(tuple(t.__name__ for t in NODE_TYPES)) for line in lines)


def test_a_limit_names_the_path_the_json_has():
    inner = Generate(input=ir.User(text="hi"), n=50)
    query = generate(cross("q", plus("a", inner)))
    with pytest.raises(QueryValidationError) as raised:
        check_limits(query, QueryLimits(max_n=4))
    ((path, _),) = [(p, n) for p, n in walk(query) if n is inner]
    assert raised.value.path == f"{path}.g.n" == "$.g.input.cross[1].plus[1].g.n"
    assert _at(to_json(query), raised.value.path) == 50

    bulk = Repeat(n=9, query=generate("hi"))
    with pytest.raises(QueryValidationError) as raised:
        check_limits(cross("q", bulk), QueryLimits(max_bulk=4))
    assert _at(to_json(cross("q", bulk)), raised.value.path) == 9


def test_a_count_over_its_limit_is_the_whole_querys_at_the_first_path_over_it_in_document_order():
    """600 fragments over a limit of 512: the error says 600 (not 513, where the walk stopped) and names the
    513th fragment in the order the JSON holds them (the walk went last child first and named the 88th)."""
    from spanq_integrations.query.limits import check_json_depth

    query = generate(cross("q", plus(*[f"document {i}" for i in range(600)])))
    with pytest.raises(QueryValidationError) as raised:
        check_limits(query)
    assert "the number of fragments is 600, over the server's limit max_fragments=512" in str(raised.value)
    assert raised.value.path == "$.g.input.cross[1].plus[512]"
    assert _at(to_json(query), raised.value.path) == {"fragment": "document 512"}

    calls = plus(*[generate(f"q{i}", n=4) for i in range(300)])  # 1200 calls, over 1024 at the 257th
    with pytest.raises(QueryValidationError) as raised:
        check_limits(calls)
    assert "the number of generate calls is 1200" in str(raised.value) and raised.value.path == "$.plus[256]"

    deep: dict = {"user": "x"}
    for _ in range(101):
        deep = {"cross": [deep]}
    with pytest.raises(QueryValidationError, match=r"the document nests 204 levels of objects and arrays, more "
                       r"than a query within the server's limit max_depth=64 can \(195"):  # fmt: skip
        check_json_depth(deep)


def test_a_retrieve_is_refused_at_its_node_in_the_limits_walk_where_the_caller_has_no_retriever():
    """A server (no retriever) refuses a retrieve in the walk that checks the limits, at its node's path; a caller
    with retrievers counts its k documents as fragments instead."""
    query = generate(cross("q", plus("a", ir.Retrieve(query="x", k=600))))
    with pytest.raises(QueryValidationError) as raised:
        check_limits(query, no_retrieve="no retriever here")
    assert raised.value.path == "$.g.input.cross[1].plus[1].retrieve" and "no retriever here" in str(raised.value)
    assert "retrieve" in _at(to_json(query), "$.g.input.cross[1].plus[1]")
    with pytest.raises(QueryValidationError, match="the number of fragments is 601"):
        check_limits(query)


BAD_BUILDS = [  # (what a user wrote, the path the error names, what it says)
    (lambda: ir.user(None), "user(text)", "a valid string, got None"),
    (lambda: ir.fragment(3), "fragment(text)", "a valid string, got 3"),
    (lambda: ir.user("a\ud800b"), "user(text)", "not valid Unicode: surrogates not allowed at index 1"),
    (lambda: generate("q", temperature=3), "generate(temperature)", "less than or equal to 2, got 3"),
    (lambda: generate("q", n=0), "generate(n)", "greater than or equal to 1, got 0"),
    (lambda: generate("q", seed=-1), "generate(seed)", "greater than or equal to 0, got -1"),
    (lambda: generate("q", cold_spans="foo"), "generate(cold_spans)", "got 'foo'"),
    (lambda: generate("q", recompute="all"), "generate(recompute)", "from 0 to 1, \"none\", or one of first"),
    (lambda: generate("q", recompute=True), "generate(recompute)", "got True"),
    (lambda: generate("q", recompute=1.5), "generate(recompute)", "got 1.5"),
    (lambda: ir.retrieve("q", k=0), "retrieve(k)", "greater than or equal to 1, got 0"),
    (lambda: ir.chat("hi", temperature=5), "chat(temperature)", "got 5"),
    (lambda: generate(ir.system("s"), ir.user("q")), "generate(model)", "join messages with cross(...)"),
    (lambda: generate([ir.user("a"), ir.user("b")]), "generate().input", "join several with cross(...)"),
    (lambda: generate("q", stop=5), "generate(stop)", "a string or a list of strings, got int"),
    (lambda: judge_query(["a", "b"], "pick", temperature=5), "judge(temperature)", "got 5"),
    (lambda: judge_query(["a", "b"], "pick", span_anchor="x"), "judge(span_anchor)", "unknown anchor policy 'x'"),
    (lambda: judge_query(["a", "b"], ""), "judge(instruction)", "need an instruction"),
    (lambda: ir.repeat("hi", 2), "repeat(query)", "as repeat(generate(...), n), got str"),
    (lambda: ir.repeat(generate("hi"), 0), "repeat(n)", "greater than or equal to 1, got 0"),
    (lambda: judge_query(["a", "b"], None), "judge(instruction)", "got NoneType"),
    (lambda: judge_query(None, "pick"), "judge(candidates)", "pass a list of candidates, got NoneType"),  # (a TypeError)
    (lambda: judge_query("a", "pick"), "judge(candidates)", "not a single one"),
    (lambda: judge_query([], "pick"), "judge(candidates)", "there are no candidates to judge"),
    # a plain string built its message or fragment without the check (it failed deep in the engine instead)
    (lambda: generate("a\ud800"), "generate().input(text)", "not valid Unicode"),
    (lambda: plus("a", "b\ud800"), "plus()[1](text)", "not valid Unicode"),
    (lambda: cross("q\udc00"), "cross()[0](text)", "not valid Unicode"),
    # pydantic read True as 1 and "0.5" as 0.5, where spnl JSON refuses both
    (lambda: generate("q", temperature=True), "generate(temperature)", "expected a number, got True"),
    (lambda: generate("q", temperature="0.5"), "generate(temperature)", "expected a number, got '0.5'"),
    (lambda: generate("q", n=True), "generate(n)", "expected an integer, got True"),
    (lambda: generate("q", max_tokens=True), "generate(max_tokens)", "expected an integer, got True"),
    (lambda: generate("q", seed=False), "generate(seed)", "expected an integer, got False"),
    (lambda: ir.repeat(generate("hi"), "3"), "repeat(n)", "expected an integer, got '3'"),
    # a map is built by its class: pydantic's ValidationError named the class and a web page
    (lambda: ir.Map(inputs="abc"), "Map(inputs)", "expected a list of input texts, got one: 'abc'"),
    (lambda: ir.Map(inputs=("a",), temperature=5), "Map(temperature)", "less than or equal to 2, got 5"),
    (lambda: ir.Map(inputs=("a",), max_tokens=True), "Map(max_tokens)", "expected an integer, got True"),
    (lambda: ir.Map(inputs=("a", "b\ud800")), "Map(inputs)[1]", "not valid Unicode"),
    # a group in a group of another role or anchor: read as the outer group's documents, silently
    (lambda: plus(plus("a", role="system"), "b"), "plus()[0]", "its own role 'system' cannot be honoured"),
    (lambda: plus("a", plus("b", anchor="prefix")), "plus()[1]", "its own anchor 'prefix' cannot be honoured"),
    # each copy a node of the plan: 10^9 filled memory for minutes before anything ran, outside a server
    (lambda: ir.repeat(generate("hi"), 10**9), "repeat(n)", "less than or equal to 1000000, got 1000000000"),
]


@pytest.mark.parametrize("build, path, says", BAD_BUILDS)
def test_a_bad_setting_in_a_builder_is_a_spanq_error_naming_the_builder_and_the_setting(build, path, says):
    """What `except SpanQueryError` catches, naming the setting: pydantic's ValidationError named the model's class
    ("1 validation error for Generate") and a web page; a second message passed to generate went into `model`."""
    with pytest.raises(QueryValidationError) as raised:
        build()
    assert raised.value.path == path and says in raised.value.message, str(raised.value)


def test_a_map_takes_its_inputs_from_any_iterable_once():
    """(A generator's items were read by the check of each input, and the map was built with none.)"""
    assert ir.Map(inputs=(text for text in ("a", "b"))).inputs == ("a", "b")


def test_metadata_json_cannot_hold_is_named_when_written_and_a_tuple_reads_back_equal():
    """`dumps` of a fragment whose metadata held an object failed in json's encoder, naming no node, and one with NaN
    wrote a bare NaN (no JSON reader takes it); a tuple in metadata read back as a list, so the query was not
    equal to itself written and read. Running such a query needs no JSON: it still builds."""
    from spanq_integrations.query.spnl_json import dumps, loads

    for query, path in [
        (generate(plus(ir.fragment("x", metadata={"a": object()}))), "$.g.input.plus[0].fragment.metadata"),
        (generate(plus(ir.fragment("x", score=float("nan")))), "$.g.input.plus[0].fragment.metadata"),
        (ir.combine(plus(generate("a"), generate("b")), "extract", x=object()), "$.combine.options"),
    ]:
        with pytest.raises(QueryValidationError, match="cannot be written as JSON") as raised:
            dumps(query)
        assert raised.value.path == path
    query = generate(plus(ir.fragment("a", metadata={"pages": (1, 2)})))
    assert query.input.children[0].metadata == {"pages": [1, 2]} and loads(dumps(query)) == query


def test_a_stop_string_is_one_stop_and_fragment_metadata_is_the_documents():
    """`stop="END"` stopped at any E, N or D (a string is iterable); `fragment(text, metadata=doc.metadata)` nested
    the dict under a key "metadata"."""
    assert generate("q", stop="END").stop == ("END",) and generate("q", stop=["a", "b"]).stop == ("a", "b")
    assert generate("q", stop="").stop == ()  # (an empty string stops nothing, as before)
    # …but one in a list went to the engine, which refused the call by its path alone ("$: …"): named here, read
    # from spnl JSON too
    with pytest.raises(QueryValidationError, match=r"generate\(stop\)\[1\]: an empty stop string"):
        generate("q", stop=["END", ""])
    with pytest.raises(QueryParseError, match=r"\$\.g\.stop\[0\]: an empty stop string"):
        spnl_json.loads('{"g": {"input": {"user": "q"}, "stop": [""]}}')
    assert ir.fragment("x", metadata={"source": "s"}, page=2).metadata == {"source": "s", "page": 2}
    assert ir.fragment("x", source="s").metadata == {"source": "s"}
    assert generate("q", recompute="none").recompute == 0.0


def test_the_plan_shows_every_setting_a_call_or_a_plus_was_given():
    """`spanq plan` and `render` showed neither an anchor nor recompute, cold spans, seed or JSON: a user could not
    see that a setting reached the plan."""
    shown = render(generate(cross(plus("a", "b", anchor="prefix"), "q"), recompute="first", seed=3,
                            cold_spans="isolate", json_schema={}))  # fmt: skip
    assert "recompute='first'" in shown and "seed=3" in shown and "cold_spans=isolate" in shown and "json=any" in shown
    assert "plus (order-free, 2, anchor=prefix)" in shown
    assert "recompute=0.25" in render(generate("q", recompute=0.25)) and "recompute" not in render(generate("q"))


def test_child_paths_are_the_direct_children_in_order():
    query = cross("a", plus("b", "c"))
    assert [p for p, _ in child_paths(query)] == ["$.cross[0]", "$.cross[1]"]
    assert [n for _, n in child_paths(query)] == list(children_of(query))
