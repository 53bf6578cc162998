"""`optimize`: rules applied to a fixpoint; idempotent on random trees, for either kind of backend."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spanq_integrations.backends.protocol import BackendCapabilities
from spanq_integrations.optimizer import (
    DEFAULT_RULES,
    OptimizerContext,
    TreeReduction,
    apply_rules,
    optimize,
    simplify_plus,
)
from spanq_integrations.query.errors import OptimizerError, QueryValidationError
from spanq_integrations.query.ir import (
    Chat,
    Cross,
    Fragment,
    Generate,
    Map,
    Monad,
    Node,
    Plus,
    Repeat,
    Retrieve,
    System,
    User,
    walk,
)
from tests.strategies import span_queries

SPAN_AWARE = BackendCapabilities(name="span", span_aware=True)
PLAIN = BackendCapabilities(name="openai", span_aware=False)


def few_fragments(query: str, k: int) -> list[Fragment]:
    """A deterministic retriever over a tiny corpus, so that queries share fragments (and sometimes find none)."""
    return [Fragment(text=f"doc {(len(query) + i) % 5}") for i in range(len(query) % (k + 1))]


RETRIEVERS = {"default": few_fragments, "wiki": few_fragments}
queries = span_queries(text=st.text(alphabet="ab ", max_size=4), retrievers=tuple(RETRIEVERS), max_leaves=10)


def assert_optimized_shape(tree: Node, capabilities: BackendCapabilities = PLAIN) -> None:
    for path, node in walk(tree):
        assert not isinstance(node, (Chat, Retrieve, Repeat, Map)), f"sugar left at {path}"
        if isinstance(node, (Plus, Cross)) and path != "$":
            # (for a span-aware backend a plus of one document stays: it is a span; and a plus whose lone child
            # would read in another role out of it: a generate's output, a system or assistant message, a cross,
            # anything of a group in the system message, a group of another role)
            lone = node.children[0] if isinstance(node, Plus) and len(node.children) == 1 else None
            lone_span = lone is not None and capabilities.span_aware and isinstance(lone, Fragment)
            keeps_role = lone is not None and (
                not isinstance(lone, (Fragment, User, Plus))
                or node.role is not None  # type: ignore[union-attr]
                or (isinstance(lone, Plus) and lone.role != node.role)  # type: ignore[union-attr]
            )
            assert len(node.children) != 1 or lone_span or keeps_role, f"single-child join at {path}"
            for child in node.children:
                # a plus in a plus stays only where the inner one names another anchor policy or role (one
                # group, one policy, one role: `simplify_plus`); any other nesting is spliced
                spliceable = (
                    isinstance(child, Plus) and isinstance(node, Plus)
                    and child.anchor in (None, node.anchor) and child.role == node.role
                )  # fmt: skip
                assert not spliceable, f"plus in plus at {path}"


@pytest.mark.parametrize("capabilities", [PLAIN, SPAN_AWARE], ids=["plain", "span-aware"])
@settings(max_examples=150, deadline=None)
@given(query=queries)
def test_optimize_is_idempotent(capabilities: BackendCapabilities, query: Node) -> None:
    once = optimize(query, capabilities, retrievers=RETRIEVERS)
    assert optimize(once, capabilities, retrievers=RETRIEVERS) == once
    assert_optimized_shape(once, capabilities)


@pytest.mark.parametrize("capabilities", [PLAIN, SPAN_AWARE], ids=["plain", "span-aware"])
@settings(max_examples=150, deadline=None)
@given(query=queries, k=st.integers(2, 4))
def test_optimize_with_every_opt_in_is_idempotent(
    capabilities: BackendCapabilities, query: Node, k: int
) -> None:
    options = {"retrievers": RETRIEVERS, "tree_reduction": k, "bulk_order": True}
    once = optimize(query, capabilities, **options)
    assert optimize(once, capabilities, **options) == once


def test_rag_judge_end_to_end_for_a_span_aware_backend() -> None:
    docs = [Fragment(text="spans are order-free", id="d1"), Fragment(text="plus is commutative", id="d2")]
    query = Chat(
        messages=(
            System(text="answer from the documents"),
            Retrieve(query="what is a span?", k=2),
            User(text="?"),
        ),
        model="m",
    )
    result = optimize(query, SPAN_AWARE, retrievers={"default": lambda q, k: docs[:k]})
    prepares = Plus(children=tuple(Generate(input=d, model="m", max_tokens=1, temperature=0.0) for d in docs))
    assert result == Generate(
        input=Cross(
            children=(
                Monad(query=prepares),
                System(text="answer from the documents"),
                Plus(children=tuple(docs)),
                User(text="?"),
            )
        ),
        model="m",
    )
    assert optimize(query, retrievers={"default": lambda q, k: docs[:k]}) == Generate(
        input=Cross(
            children=(System(text="answer from the documents"), Plus(children=tuple(docs)), User(text="?"))
        ),
        model="m",
    )


def test_repeat_inside_judge_becomes_a_tree_of_judges() -> None:
    candidate = Generate(input=User(text="write an email"), model="m", temperature=0.9)
    judge = Generate(
        input=Cross(children=(System(text="pick"), Plus(children=(Repeat(n=4, query=candidate),)))), model="m"
    )
    result = optimize(judge, tree_reduction=2)
    pair = Generate(
        input=Cross(children=(System(text="pick"), Plus(children=(candidate, candidate)))), model="m"
    )
    assert result == Generate(
        input=Cross(children=(System(text="pick"), Plus(children=(pair, pair)))), model="m"
    )


def test_nothing_to_do_returns_the_query_itself() -> None:
    q = Generate(input=Cross(children=(System(text="s"), User(text="u"))))
    assert optimize(q) is q


def test_custom_rule_list() -> None:
    q = Plus(
        children=(Plus(children=(Fragment(text="a"), Fragment(text="b"))), Chat(messages=(User(text="hi"),)))
    )
    assert optimize(q, rules=[simplify_plus]) == Plus(
        children=(Fragment(text="a"), Fragment(text="b"), Chat(messages=(User(text="hi"),)))
    )


def test_a_rule_that_never_settles_is_reported() -> None:
    def flip(node: Node, ctx: OptimizerContext) -> Node:
        return User(text="b") if node == User(text="a") else User(text="a")

    with pytest.raises(OptimizerError, match=r"did not settle after 5 passes \(rules: flip\)"):
        apply_rules(User(text="a"), OptimizerContext(), [flip], max_passes=5)


def test_unknown_retriever_surfaces_from_optimize() -> None:
    with pytest.raises(OptimizerError, match='no retriever named "default"'):
        optimize(Generate(input=Retrieve(query="q")))


def test_bad_tree_reduction_surfaces_from_optimize() -> None:
    with pytest.raises(QueryValidationError, match="tree_reduction.k must be an integer >= 2"):
        optimize(User(text="u"), tree_reduction=1)
    with pytest.raises(QueryValidationError, match="tree_reduction is a TreeReduction or a fan-in k"):
        optimize(User(text="u"), tree_reduction="2")  # type: ignore[arg-type]
    with pytest.raises(QueryValidationError, match="combines in code with a reducer"):
        TreeReduction(k=2, combine="code")
    with pytest.raises(QueryValidationError, match="combines in code with a reducer"):
        TreeReduction(k=2, reducer="extract")  # a reducer with model calls: one of the two is a mistake
    with pytest.raises(QueryValidationError, match="by 'model' or 'code', not 'auto'"):
        TreeReduction(k=2, combine="auto")  # type: ignore[arg-type]  # `auto` is judge()'s, resolved there


def test_default_rules_are_in_design_order() -> None:
    assert [rule.__name__ for rule in DEFAULT_RULES] == [
        "desugar_chat",
        "desugar_retrieve",
        "expand_bulk",
        "simplify_plus",
        "distribute_plus",
        "tree_reduce",
        "bulk_order",
    ]
