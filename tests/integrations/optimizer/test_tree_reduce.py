"""Rule 5: a wide judge becomes a k-ary tree of narrow judges with the same instruction and settings."""

from __future__ import annotations

import pytest

from spanq_integrations.optimizer import OptimizerContext, TreeReduction, tree_reduce
from spanq_integrations.query.errors import OptimizerError, QueryValidationError
from spanq_integrations.query.ir import (
    Combine,
    Cross,
    Fragment,
    Generate,
    Monad,
    Node,
    Plus,
    Print,
    System,
    User,
    walk,
)

S, U = System(text="you judge emails"), User(text="pick the best one")


def candidates(n: int) -> list[Fragment]:
    return [Fragment(text=f"c{i}") for i in range(n)]


def judge_over(*group: Node, prefix: tuple[Node, ...] = (S,), suffix: tuple[Node, ...] = (U,)) -> Generate:
    return Generate(
        input=Cross(children=(*prefix, Plus(children=group), *suffix)),
        model="m",
        max_tokens=50,
        temperature=0.2,
    )


def reduce(node: Node, k: int, instruction: str | None = None) -> Node:
    return tree_reduce(node, OptimizerContext(tree_reduction=TreeReduction(k=k, instruction=instruction)))


def depth_of_judges(node: Node) -> int:
    if not isinstance(node, Generate):
        return 0
    return 1 + max((depth_of_judges(n) for _, n in walk(node.input) if isinstance(n, Generate)), default=0)


def test_eight_candidates_two_at_a_time_take_seven_calls_in_three_levels() -> None:
    c = candidates(8)
    result = reduce(judge_over(*c), k=2)
    level1 = [judge_over(c[0], c[1]), judge_over(c[2], c[3]), judge_over(c[4], c[5]), judge_over(c[6], c[7])]
    level2 = [judge_over(level1[0], level1[1]), judge_over(level1[2], level1[3])]
    assert result == judge_over(*level2)
    assert sum(isinstance(n, Generate) for _, n in walk(result)) == 7
    assert depth_of_judges(result) == 3


def test_a_group_of_one_passes_through_without_a_call() -> None:
    c = candidates(5)
    result = reduce(judge_over(*c), k=2)
    pairs = [judge_over(c[0], c[1]), judge_over(c[2], c[3])]
    assert result == judge_over(judge_over(*pairs), c[4])


def test_k_of_three() -> None:
    c = candidates(7)
    result = reduce(judge_over(*c), k=3)
    assert result == judge_over(judge_over(c[0], c[1], c[2]), judge_over(c[3], c[4], c[5]), c[6])


def test_judges_keep_every_setting_but_n_and_the_join_keywords() -> None:
    """Every judge keeps the query's model, sampling and stop settings; only the root gives the query's n choices —
    a judge below it answers once (with n copied down, the level above read k*n answers)."""
    g = Generate(
        input=Cross(keyword="seq", children=(S, Plus(keyword="par", children=tuple(candidates(3))), U)),
        model="m",
        max_tokens=9,
        temperature=0.0,
        n=2,
        stop=("END",),
        seed=3,
    )
    c = candidates(3)
    inner = g.model_copy(
        update={"input": Cross(keyword="seq", children=(S, Plus(keyword="par", children=(c[0], c[1])), U)), "n": 1}
    )
    assert reduce(g, k=2) == g.model_copy(
        update={"input": Cross(keyword="seq", children=(S, Plus(keyword="par", children=(inner, c[2])), U))}
    )


def test_bare_plus_input() -> None:
    c = candidates(3)
    g = Generate(input=Plus(children=tuple(c)))
    assert reduce(g, k=2) == Generate(
        input=Plus(children=(Generate(input=Plus(children=(c[0], c[1]))), c[2]))
    )


def test_intermediate_instruction() -> None:
    c = candidates(3)
    relay = User(text="repeat the best candidate verbatim")
    result = reduce(judge_over(*c), k=2, instruction=relay.text)
    assert result == judge_over(judge_over(c[0], c[1], suffix=(relay,)), c[2])


def test_effects_run_once_in_the_root() -> None:
    warm = Monad(query=Generate(input=Fragment(text="c0"), max_tokens=1))
    note = Print(text="judging")
    c = candidates(3)
    g = Generate(input=Cross(children=(warm, S, Plus(children=(note, *c)), U)))
    assert reduce(g, k=2) == Generate(
        input=Cross(
            children=(
                warm,
                S,
                Plus(
                    children=(note, Generate(input=Cross(children=(S, Plus(children=(c[0], c[1])), U))), c[2])
                ),
                U,
            )
        )
    )


def test_narrow_or_ambiguous_judges_are_left_alone() -> None:
    narrow = judge_over(*candidates(2))
    assert reduce(narrow, k=2) is narrow
    two_sets = Generate(
        input=Cross(children=(Plus(children=tuple(candidates(3))), Plus(children=tuple(candidates(3)))))
    )
    assert reduce(two_sets, k=2) is two_sets
    assert reduce(Generate(input=U), k=2) == Generate(input=U)


def test_inner_judges_are_reduced_too() -> None:
    c = candidates(3)
    inner = judge_over(*c)
    outer = Generate(input=Cross(children=(S, Plus(children=(inner, Fragment(text="x"))), U)))
    reduced_inner = judge_over(judge_over(c[0], c[1]), c[2])
    assert reduce(outer, k=2) == Generate(
        input=Cross(children=(S, Plus(children=(reduced_inner, Fragment(text="x"))), U))
    )


def test_off_by_default() -> None:
    g = judge_over(*candidates(8))
    assert tree_reduce(g, OptimizerContext()) is g


@pytest.mark.parametrize("k", [1, 0, -3])
def test_k_below_two_is_an_error(k: int) -> None:
    with pytest.raises(QueryValidationError, match="tree_reduction.k must be an integer >= 2"):
        TreeReduction(k=k)


# ------------------------------------------------------------------------------------ combining in code


def reduce_in_code(node: Node, k: int, instruction: str | None = None) -> Node:
    plan = TreeReduction(
        k=k, combine="code", instruction=instruction, reducer="extract", options={"item_pattern": "[A-Z]+"}
    )
    ctx = OptimizerContext(tree_reduction=plan)
    return tree_reduce(node, ctx)


def test_combined_in_code_eight_candidates_take_four_leaves_and_no_call_above() -> None:
    out = reduce_in_code(judge_over(*candidates(8)), k=2, instruction="list the items")
    assert isinstance(out, Combine)
    assert out.reducer == "extract" and out.options == {"item_pattern": "[A-Z]+"}
    assert isinstance(out.input, Plus)
    leaves = out.input.children
    assert all(isinstance(g, Generate) for g in leaves)
    assert sum(isinstance(n, Generate) for _, n in walk(out)) == 4
    assert [[c.text for c in g.input.children[1].children] for g in leaves] == [
        ["c0", "c1"], ["c2", "c3"], ["c4", "c5"], ["c6", "c7"]
    ]  # fmt: skip
    for g in leaves:  # same settings and prefix, the leaf instruction
        assert (g.model, g.max_tokens, g.temperature) == ("m", 50, 0.2)
        assert g.input.children[0] == S and g.input.children[2] == User(text="list the items")
    assert reduce_in_code(out, k=2) == out  # a fixed point: the optimizer settles


def test_combined_in_code_a_group_of_one_is_still_read() -> None:
    out = reduce_in_code(judge_over(*candidates(5)), k=2)
    leaves = out.input.children
    assert len(leaves) == 3 and all(isinstance(g, Generate) for g in leaves)
    assert [c.text for c in leaves[2].input.children[1].children] == ["c4"]
    assert leaves[0].input.children[2] == U  # no leaf instruction: the query's own


def test_combined_in_code_narrow_judges_stay_one_call_and_effects_run_once() -> None:
    narrow = judge_over(*candidates(2))
    assert reduce_in_code(narrow, k=2) == narrow
    warm, note = Monad(query=Fragment(text="warm")), Print(text="judging")
    wide = judge_over(*candidates(4), warm, prefix=(note, S))
    out = reduce_in_code(wide, k=2)
    effects = [c for c in out.input.children if not isinstance(c, Generate)]
    assert effects == [note, warm]
    assert all(n not in (note, warm) for g in out.input.children[2:] for _, n in walk(g))


def test_a_judge_combined_in_code_gives_one_verdict_and_refuses_n() -> None:
    g = judge_over(*candidates(4)).model_copy(update={"n": 3})
    plan = TreeReduction(k=2, combine="code", reducer="count")
    with pytest.raises(OptimizerError, match="n=3"):
        tree_reduce(g, OptimizerContext(tree_reduction=plan))
    leaves = tree_reduce(g.model_copy(update={"n": 1}), OptimizerContext(tree_reduction=plan))
    assert isinstance(leaves, Combine) and all(n.n == 1 for _, n in walk(leaves) if isinstance(n, Generate))

