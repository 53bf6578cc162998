"""Rule 6: a top-level batch is ordered so queries that share fragments run next to each other."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from spanq_integrations.optimizer import OptimizerContext, bulk_order
from spanq_integrations.query.ir import Cross, Fragment, Generate, Plus, User

ON = OptimizerContext(bulk_order=True)


def ask(name: str, *docs: Fragment) -> Generate:
    return Generate(input=Cross(children=(Plus(children=docs) if docs else User(text="-"), User(text=name))))


A, B, C, D = (Fragment(text=f"document {x}") for x in "ABCD")


def test_queries_sharing_fragments_become_neighbours() -> None:
    q0, q1, q2, q3 = ask("q0", A, B), ask("q1", C, D), ask("q2", A, B, C), ask("q3", D, C)
    batch = Plus(children=(q0, q1, q2, q3))
    # q2 shares the most (A, B, C); then q0 (A, B in common), then q1 (nothing with q0; ties to the earliest),
    # then q3
    assert bulk_order(batch, ON) == Plus(children=(q2, q0, q1, q3))


def test_greedy_follows_the_largest_overlap_with_the_last_query() -> None:
    q0, q1, q2, q3 = ask("q0", A), ask("q1", C, D), ask("q2", A, B, C, D), ask("q3", B, D)
    # q2 shares all four; q1 and q3 both overlap it by two: the earlier, q1, goes first; then q3, which shares
    # D with q1, beats the earlier q0, which shares nothing with it
    assert bulk_order(Plus(children=(q0, q1, q2, q3)), ON) == Plus(children=(q2, q1, q3, q0))


def test_fragments_are_known_by_id_before_text() -> None:
    same_id = [Fragment(text=f"version {i}", id="doc-7") for i in range(2)]
    q0, q1, q2 = ask("q0", Fragment(text="other")), ask("q1", same_id[0]), ask("q2", same_id[1])
    assert bulk_order(Plus(children=(q0, q1, q2)), ON) == Plus(children=(q1, q2, q0))


def test_nothing_shared_keeps_the_order() -> None:
    batch = Plus(keyword="par", children=(ask("a", A), ask("b", B), ask("c", C)))
    assert bulk_order(batch, ON) == batch


def test_ordering_an_ordered_batch_changes_nothing() -> None:
    batch = Plus(children=(ask("q0", A, B), ask("q1", C, D), ask("q2", A, B, C), ask("q3", D, C)))
    once = bulk_order(batch, ON)
    assert bulk_order(once, ON) == once


def test_only_the_root_batch_and_only_when_asked() -> None:
    batch = Plus(children=(ask("q0", A), ask("q1", B), ask("q2", B)))
    assert bulk_order(batch, OptimizerContext()) is batch
    nested = Generate(input=Cross(children=(batch, User(text="merge"))))
    assert bulk_order(nested, ON) is nested


corpus = st.sampled_from([A, B, C, D, Fragment(text="document A", id="a")])
batches = st.lists(st.lists(corpus, min_size=0, max_size=3), min_size=3, max_size=8).map(
    lambda docs: Plus(children=tuple(ask(f"q{i}", *d) for i, d in enumerate(docs)))
)


@given(batches)
def test_ordering_is_a_stable_permutation(batch: Plus) -> None:
    ordered = bulk_order(batch, ON)
    assert sorted(map(repr, ordered.children)) == sorted(map(repr, batch.children))
    assert bulk_order(ordered, ON) == ordered
