"""Rule 3: flat, non-empty, multi-child joins."""

from __future__ import annotations

from spanq_integrations.optimizer import OptimizerContext, simplify_plus
from spanq_integrations.query.ir import Cross, Fragment, Generate, Monad, Node, Plus, System, User

A, B, C, D = (Fragment(text=t) for t in "abcd")
S, U = System(text="s"), User(text="u")


def simplify(node: Node) -> Node:
    return simplify_plus(node, OptimizerContext())


def test_nested_plus_is_flattened_keeping_the_outer_keyword() -> None:
    q = Plus(keyword="par", children=(A, Plus(children=(B, Plus(children=(C, D))))))
    assert simplify(q) == Plus(keyword="par", children=(A, B, C, D))


def test_nested_cross_is_flattened_only_with_the_same_keyword() -> None:
    q = Cross(children=(S, Cross(children=(A, B)), Cross(keyword="seq", children=(C, U))))
    assert simplify(q) == Cross(children=(S, A, B, Cross(keyword="seq", children=(C, U))))


def test_plus_inside_cross_inside_plus_stays_nested() -> None:
    q = Plus(children=(A, Cross(children=(S, Plus(children=(B, C))))))
    assert simplify(q) == q


def test_empty_joins_are_dropped_from_their_parent() -> None:
    q = Cross(children=(S, Plus(children=()), Cross(children=()), U))
    assert simplify(q) == Cross(children=(S, U))


def test_single_child_joins_are_replaced_by_their_child() -> None:
    q = Generate(input=Cross(children=(S, Plus(children=(A,)), Cross(children=(Plus(children=(B, C)),)), U)))
    assert simplify(q) == Generate(input=Cross(children=(S, A, Plus(children=(B, C)), U)))


def test_a_lone_document_stays_a_span_for_a_span_aware_backend() -> None:
    """One document in a `plus` is still a span to reuse after another question; elsewhere it is just text."""
    from spanq_integrations.optimizer.context import BackendCapabilities

    q = Generate(input=Cross(children=(S, Plus(children=(A,)), Cross(children=(Plus(children=(Plus(children=(B,)),)),)), U)))
    span_aware = OptimizerContext(capabilities=BackendCapabilities(name="span", span_aware=True))
    assert simplify_plus(q, span_aware) == Generate(input=Cross(children=(S, Plus(children=(A,)), Plus(children=(B,)), U)))
    assert simplify(q) == Generate(input=Cross(children=(S, A, B, U)))


def test_joins_emptied_by_simplification_disappear_in_one_pass() -> None:
    q = Cross(children=(S, Plus(children=(Plus(children=()), Cross(children=()))), U))
    assert simplify(q) == Cross(children=(S, U))


def test_empty_joins_without_a_parent_join_stay() -> None:
    for q in (Plus(children=()), Generate(input=Plus(children=())), Monad(query=Cross(children=()))):
        assert simplify(q) == q


def test_a_simple_tree_is_returned_as_is() -> None:
    q = Generate(input=Cross(children=(S, Plus(children=(A, B)), U)))
    assert simplify(q) is q


def test_a_lone_child_that_would_change_role_out_of_its_plus_stays_in_it() -> None:
    """A `plus` child is user content. Out of it, a generate's output would be an assistant turn (a judge would
    read the candidate as its own earlier reply), a system message a system turn: such a plus stays."""
    from spanq_integrations.query.flatten import to_chat_messages
    from spanq_integrations.query.ir import Assistant

    poem = Generate(input=User(text="a poem"))
    for lone in (poem, Assistant(text="an answer"), System(text="rules"), Cross(children=(S, U))):
        q = Generate(input=Cross(children=(S, Plus(children=(lone,)), U)))
        assert simplify(q) == q, lone
    closed = Cross(children=(S, Plus(children=(Assistant(text="an answer"),)), U))
    assert [m["role"] for m in to_chat_messages(simplify(closed))] == ["system", "user"]
    assert simplify(Cross(children=(S, Plus(children=(U,)), A))) == Cross(children=(S, U, A))

