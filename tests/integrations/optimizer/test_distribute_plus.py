"""Rule 4: inner generates read through a plus are its direct children; provenance and inner inputs survive."""

from __future__ import annotations

from spanq_integrations.backends.protocol import BackendCapabilities
from spanq_integrations.optimizer import OptimizerContext, distribute_plus
from spanq_integrations.query.ir import Assistant, Cross, Fragment, Generate, Monad, Plus, System, User

SPAN_AWARE = OptimizerContext(capabilities=BackendCapabilities(name="span", span_aware=True))
PLAIN = OptimizerContext(capabilities=BackendCapabilities(name="openai", span_aware=False))

JUDGE = System(text="pick the best email")
ASK = User(text="which one?")
G1 = Generate(input=Cross(children=(System(text="write"), Plus(children=(Fragment(text="cv"),)))), model="m")
G2 = Generate(input=User(text="write another"), model="m")


def test_wrapped_inner_generates_are_pulled_up() -> None:
    q = Generate(
        input=Cross(children=(JUDGE, Plus(children=(Cross(children=(G1,)), Plus(children=(G2,)))), ASK))
    )
    assert distribute_plus(q, SPAN_AWARE) == Generate(
        input=Cross(children=(JUDGE, Plus(children=(G1, G2)), ASK))
    )


def test_plus_of_inner_generates_is_spliced_into_its_parent_plus() -> None:
    x = Fragment(text="x")
    q = Generate(input=Plus(children=(Plus(children=(G1, x)), G2)))
    assert distribute_plus(q, SPAN_AWARE) == Generate(input=Plus(children=(G1, x, G2)))


def test_a_group_with_its_own_anchor_policy_is_not_spliced_into_another() -> None:
    x = Fragment(text="x")
    own = Plus(children=(G1, x), anchor="prefix")
    q = Generate(input=Plus(children=(own, G2), anchor="template"))
    assert distribute_plus(q, SPAN_AWARE) == q, "x would lose its group's prefix anchor"
    same = Generate(input=Plus(children=(Plus(children=(G1, x), anchor="system"), G2), anchor="system"))
    assert distribute_plus(same, SPAN_AWARE) == Generate(input=Plus(children=(G1, x, G2), anchor="system"))


def test_inner_generates_are_moved_never_changed() -> None:
    q = Generate(input=Cross(children=(JUDGE, Plus(children=(Cross(children=(G1,)), G2)), ASK)))
    result = distribute_plus(q, SPAN_AWARE)
    moved = result.input.children[1].children
    assert moved[0] is G1 and moved[1] is G2  # the inner input, single-child plus included, is intact


def test_closed_assistants_keep_their_source() -> None:
    closed = Assistant(text="Dear IBM, ...", source=G1)
    q = Generate(input=Cross(children=(JUDGE, Plus(children=(closed, Cross(children=(G2,)))), ASK)))
    result = distribute_plus(q, SPAN_AWARE)
    assert result == Generate(input=Cross(children=(JUDGE, Plus(children=(closed, G2)), ASK)))
    assert result.input.children[1].children[0] is closed
    assert closed.source is G1


def test_sources_are_never_rewritten() -> None:
    source = Generate(input=Plus(children=(Cross(children=(G2,)), Fragment(text="y"))))
    closed = Assistant(text="done", source=source)
    assert distribute_plus(closed, SPAN_AWARE) is closed


def test_monads_and_plus_outside_generates_are_left_alone() -> None:
    batch = Plus(children=(Cross(children=(G1,)), G2))
    assert distribute_plus(batch, SPAN_AWARE) is batch
    warm = Generate(input=Cross(children=(Monad(query=Plus(children=(Cross(children=(G2,)),))), ASK)))
    assert distribute_plus(warm, SPAN_AWARE) == warm


def test_no_op_for_backends_that_are_not_span_aware() -> None:
    q = Generate(input=Plus(children=(Cross(children=(G1,)), Plus(children=(G2, Fragment(text="x"))))))
    assert distribute_plus(q, PLAIN) is q
