"""Hypothesis strategies for random span-query trees, shared by the tests of every module that takes a query."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

from spanq_integrations.query.ir import (
    ANCHOR_POLICIES,
    SPAN_ROLES,
    Assistant,
    Chat,
    Combine,
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
    mixed_group,
)

__all__ = ["json_values", "span_queries", "spnl_core_queries"]

json_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
)
json_values: st.SearchStrategy[Any] = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=6,
)
"""Values that survive a JSON round trip unchanged (fragment metadata)."""


def _settings(text: st.SearchStrategy[str]) -> dict[str, st.SearchStrategy[Any]]:
    return {
        "model": st.sampled_from(["", "m/a", "ollama/granite3.2:2b"]) | text,
        "max_tokens": st.integers(min_value=0, max_value=2**31),
        "temperature": st.floats(min_value=0.0, max_value=2.0, allow_nan=False),
    }


def span_queries(
    *,
    text: st.SearchStrategy[str] | None = None,
    sugar: bool = True,
    retrievers: Sequence[str] = ("default",),
    max_leaves: int = 12,
) -> st.SearchStrategy[Node]:
    """Random query trees: every node kind, both keywords of each join, generated assistants with a source.

    Joins and chats are never empty (as the builders guarantee). `text` draws every string (default: any
    text); a small alphabet makes fragments repeat. `sugar=False` leaves out `Chat`, `Retrieve`, `Repeat` and
    `Map`; `retrievers` are the names a `Retrieve` may use.
    """
    text = st.text(max_size=12) if text is None else text
    settings = _settings(text)
    fragments = st.builds(
        Fragment,
        text=text,
        id=st.none() | text,
        metadata=st.dictionaries(st.text(max_size=5), json_values, max_size=2),
    )
    leaves = [
        st.builds(System, text=text),
        st.builds(User, text=text),
        st.builds(Assistant, text=text),
        fragments,
        st.builds(Print, text=text),
    ]
    if sugar:
        leaves += [
            st.builds(Retrieve, query=text, k=st.integers(1, 4), retriever=st.sampled_from(list(retrievers))),
            st.builds(Map, inputs=st.lists(text, max_size=3).map(tuple), **settings),
        ]

    def extend(children: st.SearchStrategy[Node]) -> st.SearchStrategy[Node]:
        some = st.lists(children, min_size=1, max_size=4).map(tuple)
        generates = st.builds(
            Generate,
            input=children,
            n=st.integers(1, 3),
            stop=st.lists(text.filter(bool), max_size=2).map(tuple),  # (an empty stop string is refused)
            seed=st.none() | st.integers(min_value=0, max_value=2**63 - 1),
            **settings,
        )
        combines = st.builds(
            Combine, input=children, reducer=st.sampled_from(["extract", "select", "count", "vote"]),
            options=st.just({}) | st.just({"system_prompt": "Judge."}),
        )  # fmt: skip
        branches = [
            st.builds(Plus, children=some, keyword=st.sampled_from(["plus", "par"]),
                      anchor=st.none() | st.sampled_from(ANCHOR_POLICIES),
                      role=st.none() | st.sampled_from(SPAN_ROLES)).filter(lambda p: mixed_group(p) is None),
            # (a plus directly in a plus with a role or anchor of its own is refused where it is: ir.mixed_group)
            st.builds(Cross, children=some, keyword=st.sampled_from(["cross", "seq"])),
            generates,
            st.builds(Monad, query=children),
            st.builds(Assistant, text=text, source=generates),
            combines,
            st.builds(Assistant, text=text, source=combines),
        ]
        if sugar:
            branches += [
                st.builds(Chat, messages=some, **settings),
                st.builds(Repeat, n=st.integers(1, 3), query=generates),
            ]
        return st.one_of(branches)

    return st.recursive(st.one_of(leaves), extend, max_leaves=max_leaves)


def spnl_core_queries(print_node: bool = True, models: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[Node]:
    """Trees of the nodes spnl itself has (no spanq extension: fragments, chats, anchors, sourced answers);
    `print_node=False` leaves out `print` (spnl's PyPI build has none), `models` draws the calls' model names."""
    text = st.text(max_size=8)
    settings = {
        "model": text if models is None else models,
        "max_tokens": st.integers(0, 50),
        "temperature": st.sampled_from([0.0, 0.6, 1.0]),
    }
    leaves = st.one_of(
        st.builds(System, text=text),
        st.builds(User, text=text),
        st.builds(Assistant, text=text),
        *([st.builds(Print, text=text)] if print_node else []),
        st.builds(Map, inputs=st.lists(text, max_size=3).map(tuple), **settings),
    )

    def extend(children: st.SearchStrategy[Node]) -> st.SearchStrategy[Node]:
        some = st.lists(children, min_size=1, max_size=3).map(tuple)
        generates = st.builds(Generate, input=children, n=st.integers(1, 3), **settings)
        return st.one_of(
            st.builds(Plus, children=some, keyword=st.sampled_from(["plus", "par"])),
            st.builds(Cross, children=some, keyword=st.sampled_from(["cross", "seq"])),
            generates,
            st.builds(Repeat, n=st.integers(1, 255), query=generates),
            st.builds(Monad, query=children),
        )

    return st.recursive(leaves, extend, max_leaves=10)
