"""Fuzzing the spnl JSON reader: any JSON a client can send is read into a query or refused with a typed,
path-naming error — never another exception (which a server would turn into a 500)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spanq_integrations.query.errors import QueryParseError, QueryValidationError
from spanq_integrations.query.ir import Node
from spanq_integrations.query.limits import DEFAULT_LIMITS, QueryLimitError, check_limits
from spanq_integrations.query.spnl_json import from_json, loads, to_json
from tests.strategies import span_queries

KEYS = ["g", "seq", "par", "cross", "plus", "user", "system", "assistant", "fragment", "repeat", "map",
        "monad", "print", "chat", "retrieve", "input", "n", "max_tokens", "temperature", "seed", "stop",
        "model", "inputs", "query", "text", "k", "metadata", "id", "metadata"]

scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**90), max_value=2**90)
    | st.floats(allow_nan=False) | st.text(max_size=8) | st.sampled_from(["\ud800", "x\udfffy", "", "hi"])
)
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=25,
)


def mutate(doc: object, data: st.DataObject) -> object:
    """A valid document with one value somewhere replaced by an arbitrary one."""
    if isinstance(doc, dict) and doc and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(doc)))
        return {**doc, key: mutate(doc[key], data)}
    if isinstance(doc, list) and doc and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(doc) - 1))
        return [*doc[:i], mutate(doc[i], data), *doc[i + 1:]]
    return data.draw(documents)


def read(doc: object) -> Node | None:
    """Read `doc` as a server does; None when it is refused the right way."""
    try:
        query = from_json(doc)  # type: ignore[arg-type]
        check_limits(query, DEFAULT_LIMITS)
    except (QueryParseError, QueryValidationError) as e:
        assert str(e).startswith("$"), f"the error does not name a path: {e}"
        return None
    return query


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
def test_any_json_is_read_or_refused_with_a_path(doc):
    query = read(doc)
    if query is not None:
        json.dumps(to_json(query), ensure_ascii=False).encode("utf-8")  # what a server answers is valid UTF-8


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(span_queries(), st.data())
def test_valid_queries_with_one_value_broken_are_read_or_refused_with_a_path(query, data):
    read(mutate(to_json(query), data))


def test_the_former_500s_are_400s_naming_the_path():
    cases = {
        '{"g":{"input":{"user":"hi"},"temperature":1e308}}': "$.g.temperature",
        '{"g":{"input":{"user":"hi"},"temperature":2.5}}': "$.g.temperature",
        '{"g":{"input":{"user":"hi"},"seed":1208925819614629174706176}}': "$.g.seed",
        '{"g":{"input":{"user":"\\ud800"}}}': "$.g.input.user",
        '{"g":{"input":{"fragment":{"text":"a","metadata":{"k":"\\udfff"}}}}}': "$.g.input.fragment.metadata",
    }
    for text, path in cases.items():
        try:
            loads(text)
        except QueryParseError as e:
            assert e.path.startswith(path), (text, e.path, str(e))
        else:
            raise AssertionError(f"accepted: {text}")


def test_limits_refuse_what_would_take_a_server_down():
    n_huge = {"g": {"max_tokens": 8, "temperature": 0, "n": 1000000000, "input": {"user": "hi"}}}
    repeat_huge = {"repeat": {"n": 500_000, "g": {"input": {"user": "hi"}}}}  # (over 10^6: refused as it is read)
    deep: dict = {"user": "x"}
    for _ in range(10_000):
        deep = {"plus": [deep]}
    many_calls = {"par": [{"repeat": {"n": 200, "g": {"input": {"user": "x"}, "n": 10}}}]}
    many_chats = {"plus": [{"chat": {"messages": [{"user": "hi"}]}}] * 1100}  # each chat is one call
    cases = [(n_huge, "max_n"), (repeat_huge, "max_bulk"), (deep, "max_depth"), (many_calls, "max_calls"),
             (many_chats, "max_calls")]
    for doc, limit in cases:
        try:
            check_limits(from_json(doc))
        except QueryLimitError as e:
            assert limit in str(e) and "--max-" in str(e), str(e)
        except QueryParseError as e:  # the nesting may already be refused while reading
            assert limit == "max_depth" and "nested too deeply" in str(e), str(e)
        else:
            raise AssertionError(f"{limit}: accepted")


def test_small_documents_that_expand_or_overflow_are_refused_by_name():
    """Found by a review: each of these took the server down or answered 500. A zip expanded while read: nested
    zips double the tree each level (40 levels of 2.6 KB ran for months); a wide one allocated a tuple per item of
    the other side's size. A whole number past a float's range overflowed
    the finiteness check; a plus of messages held spans past `max_fragments` (only fragments were counted)."""
    nested: dict = {"user": "a"}
    for _ in range(40):
        nested = {"zip": {"first": nested, "second": {"cross": [{"user": "a"}, {"user": "b"}]}}}
    wide = {"zip": {"first": {"plus": [{"user": f"u{i}"} for i in range(2000)]},
                    "second": {"cross": [{"user": f"v{i}"} for i in range(2000)]}}}
    for doc in (nested, wide):
        with pytest.raises(QueryParseError, match="the zip expands to .* query nodes, over"):
            from_json(doc)
    huge = json.loads('{"g": {"input": {"user": "hi"}, "temperature": 1' + "0" * 400 + "}}")
    with pytest.raises(QueryParseError, match="finite number") as e:
        from_json(huge)
    assert e.value.path == "$.g.temperature"
    many = {"g": {"input": {"plus": [{"user": f"document {i}"} for i in range(600)]}}}
    with pytest.raises(QueryLimitError, match="max_fragments"):
        check_limits(from_json(many))
    check_limits(from_json({"g": {"input": {"plus": [{"user": f"document {i}"} for i in range(500)]}}}))


def test_an_extract_pattern_that_does_not_compile_is_refused_and_one_that_backtracks_without_end_is_stopped():
    import time

    from spanq_integrations.query.errors import QueryValidationError
    from spanq_integrations.runtime.reducers import ExtractReducer, reducer_from_combine

    for options, what in (({"item_pattern": "("}, "not a regular expression"), ({"item_pattern": 5}, "must be a string"),
                          ({"item_pattern": "a" * 600}, "over 512")):
        with pytest.raises(QueryValidationError, match=what) as e:
            reducer_from_combine("extract", options, "$")
        assert e.value.path == "$.combine.options"
    reducer = ExtractReducer(item_pattern=r"(a+)+$")
    started = time.perf_counter()
    items = reducer.parse("- " + "a" * 5000 + "b\n- c", path="$")  # Python's re would run for ages
    assert time.perf_counter() - started < 10 and "c" in items, items
    assert ExtractReducer(item_pattern=r"\d+").parse("1, 22 and 1", path="$") == ["1", "22"]
