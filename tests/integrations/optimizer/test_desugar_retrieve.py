"""Rule 2: a retrieval becomes its fragments, with prepare calls for span-aware backends."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from spanq_integrations.backends.protocol import BackendCapabilities
from spanq_integrations.optimizer import OptimizerContext, desugar_retrieve, simplify_plus
from spanq_integrations.query.errors import OptimizerError
from spanq_integrations.query.ir import Cross, Fragment, Generate, Monad, Plus, Retrieve, System, User

SPAN_AWARE = BackendCapabilities(name="span", span_aware=True)
S, U = System(text="answer from the documents"), User(text="what is a span?")
DOCS = [
    Fragment(text="doc one", id="d1"),
    Fragment(text="doc two", id="d2"),
    Fragment(text="doc three", id="d3"),
]


def corpus(query: str, k: int) -> list[Fragment]:
    return DOCS[:k]


def prepare(fragment: Fragment, model: str) -> Generate:
    return Generate(input=fragment, model=model, max_tokens=1, temperature=0.0)


def test_retrieve_becomes_plus_of_fragments() -> None:
    calls: list[tuple[str, int]] = []

    def retriever(query: str, k: int) -> list[Fragment]:
        calls.append((query, k))
        return DOCS[:k]

    q = Generate(input=Cross(children=(S, Retrieve(query="span", k=2), U)), model="m")
    result = desugar_retrieve(q, OptimizerContext(retrievers={"default": retriever}))
    assert result == Generate(input=Cross(children=(S, Plus(children=(DOCS[0], DOCS[1])), U)), model="m")
    assert calls == [("span", 2)]


def test_span_aware_backend_gets_prepare_calls_first_in_the_reading_input() -> None:
    q = Generate(input=Cross(keyword="seq", children=(S, Retrieve(query="span", k=2), U)), model="m")
    result = desugar_retrieve(q, OptimizerContext(capabilities=SPAN_AWARE, retrievers={"default": corpus}))
    prepares = Monad(query=Plus(children=(prepare(DOCS[0], "m"), prepare(DOCS[1], "m"))))
    assert result == Generate(
        input=Cross(keyword="seq", children=(prepares, S, Plus(children=(DOCS[0], DOCS[1])), U)), model="m"
    )


def test_input_that_is_not_a_cross_is_wrapped_behind_the_prepares() -> None:
    q = Generate(input=Retrieve(query="span", k=1), model="m")
    result = desugar_retrieve(q, OptimizerContext(capabilities=SPAN_AWARE, retrievers={"default": corpus}))
    assert result == Generate(
        input=Cross(
            children=(Monad(query=Plus(children=(prepare(DOCS[0], "m"),))), Plus(children=(DOCS[0],)))
        ),
        model="m",
    )


def test_prepares_belong_to_the_nearest_reading_generate() -> None:
    inner = Generate(input=Cross(children=(Retrieve(query="x", k=1), User(text="summarize"))), model="small")
    outer = Generate(
        input=Cross(children=(S, Plus(children=(inner, Retrieve(query="y", k=1))), U)), model="big"
    )
    result = desugar_retrieve(
        outer, OptimizerContext(capabilities=SPAN_AWARE, retrievers={"default": corpus})
    )
    lowered_inner = Generate(
        input=Cross(
            children=(
                Monad(query=Plus(children=(prepare(DOCS[0], "small"),))),
                Plus(children=(DOCS[0],)),
                User(text="summarize"),
            )
        ),
        model="small",
    )
    assert result == Generate(
        input=Cross(
            children=(
                Monad(query=Plus(children=(prepare(DOCS[0], "big"),))),
                S,
                Plus(children=(lowered_inner, Plus(children=(DOCS[0],)))),
                U,
            )
        ),
        model="big",
    )


def test_a_fragment_retrieved_twice_is_prepared_once() -> None:
    q = Generate(input=Cross(children=(Retrieve(query="a", k=2), Retrieve(query="b", k=1))), model="m")
    result = desugar_retrieve(q, OptimizerContext(capabilities=SPAN_AWARE, retrievers={"default": corpus}))
    assert result.input.children[0] == Monad(
        query=Plus(children=(prepare(DOCS[0], "m"), prepare(DOCS[1], "m")))
    )


def test_retrieval_outside_any_generate_gets_no_prepares() -> None:
    result = desugar_retrieve(
        Retrieve(query="x", k=2), OptimizerContext(capabilities=SPAN_AWARE, retrievers={"default": corpus})
    )
    assert result == Plus(children=(DOCS[0], DOCS[1]))


def test_nothing_found_leaves_an_empty_plus_that_simplification_removes() -> None:
    ctx = OptimizerContext(capabilities=SPAN_AWARE, retrievers={"default": lambda query, k: []})
    q = Generate(input=Cross(children=(S, Retrieve(query="nothing"), U)))
    lowered = desugar_retrieve(q, ctx)
    assert lowered == Generate(input=Cross(children=(S, Plus(children=()), U)))
    assert simplify_plus(lowered, ctx) == Generate(input=Cross(children=(S, U)))


def test_texts_dicts_and_fragments_are_accepted_and_cut_to_k() -> None:
    def mixed(query: str, k: int) -> Sequence[Any]:
        return [
            "plain",
            {"text": "with id", "id": "x", "metadata": {"score": 0.5}},
            Fragment(text="f"),
            "extra",
        ]

    result = desugar_retrieve(
        Retrieve(query="q", k=3, retriever="mixed"), OptimizerContext(retrievers={"mixed": mixed})
    )
    assert result == Plus(
        children=(
            Fragment(text="plain"),
            Fragment(text="with id", id="x", metadata={"score": 0.5}),
            Fragment(text="f"),
        )
    )


def test_unknown_retriever_is_named_with_the_registered_ones() -> None:
    ctx = OptimizerContext(retrievers={"wiki": corpus, "docs": corpus})
    with pytest.raises(
        OptimizerError, match=r'no retriever named "web" is registered \(registered: docs, wiki\)'
    ):
        desugar_retrieve(Retrieve(query="q", retriever="web"), ctx)
    with pytest.raises(OptimizerError, match=r"registered: none") as raised:
        desugar_retrieve(Retrieve(query="q"), OptimizerContext())
    # the advice fits where the query ran: execute() takes retrievers too; a CLI or server query carries fragments
    assert "to execute() or optimize()" in str(raised.value) and "as fragments of a plus" in str(raised.value)


def test_retrievers_given_as_anything_but_a_dict_of_functions_are_refused_saying_the_shape() -> None:
    from spanq_integrations.optimizer import optimize

    for wrong in ([corpus], corpus, {"default": "not a function"}):
        with pytest.raises(OptimizerError, match=r"retrievers must be a dict of names to functions, as \{'default'"):
            optimize(Generate(input=Retrieve(query="q"), model="m"), retrievers=wrong)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ([42], 'retriever "default" returned a value of type int; expected a Fragment, a string or a dict'),
        ([{"txt": "typo"}], 'retriever "default" returned a dict that is not a fragment'),
    ],
)
def test_retriever_answers_that_are_not_fragments(answer: list[Any], message: str) -> None:
    with pytest.raises(OptimizerError, match=message):
        desugar_retrieve(
            Retrieve(query="q"), OptimizerContext(retrievers={"default": lambda query, k: answer})
        )


def test_a_failing_retriever_is_named() -> None:
    def broken(query: str, k: int) -> list[str]:
        raise ConnectionError("index offline")

    with pytest.raises(OptimizerError, match=r"retriever \"default\" failed on 'q': index offline"):
        desugar_retrieve(Retrieve(query="q"), OptimizerContext(retrievers={"default": broken}))
    # one that returns nothing, or takes one argument: the error says how a retriever is called
    for wrong in (lambda query, k: None, lambda query: [query]):
        with pytest.raises(OptimizerError, match=r"is called as fn\(query, k\) and returns a list"):
            desugar_retrieve(Retrieve(query="q"), OptimizerContext(retrievers={"default": wrong}))


def test_a_backend_that_prepares_spans_itself_gets_no_prepare_calls() -> None:
    own = BackendCapabilities(name="embedded", span_aware=True, prepares_spans=True)
    q = Generate(input=Cross(children=(S, Retrieve(query="x", k=2), U)), model="m")
    result = desugar_retrieve(q, OptimizerContext(capabilities=own, retrievers={"default": corpus}))
    assert result == Generate(input=Cross(children=(S, Plus(children=(DOCS[0], DOCS[1])), U)), model="m")
