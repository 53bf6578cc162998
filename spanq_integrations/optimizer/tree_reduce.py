"""Rule 5, tree reduction (attention locality): one wide judge over N candidates becomes a k-ary tree of narrow
judges, so no candidate is lost in the middle of a long context. Opt-in (`TreeReduction`); it needs no
special server.

It applies to a generate whose input is a `plus` of candidates, or a `cross` with exactly one `plus` child
(the candidates) between a prefix (system prompt, context) and a suffix (the instruction), when there are more
than k candidates. The candidates are grouped k at a time, in order; each group is judged by a generate with
the same settings and the same surrounding cross over `plus(group)`; a group of one passes through without a
call. The next level groups the previous level's judges, until at most k remain, which the original generate
then reads. N=8, k=2 gives 4 + 2 + 1 = 7 calls in 3 levels.

Monads and prints are effects, not candidates or context: in the candidate `plus` they stay with the root
judge, in the prefix and suffix they run once, in the root judge's input, not in every intermediate judge.
With the reduction's `instruction` set, the intermediate judges read that user instruction instead of the
suffix (for example "pick the best candidate and repeat it verbatim"), the root keeps the query's own.

**Combining in code** (`combine="code"` with a reducer whose combine step is exact: a union, a sum, a vote,
the highest score): there are no model calls above the leaves. The candidates are grouped k at a time, every
group (a group of one too: extracting or rating is work on the text itself) is read by one leaf judge, and a
`Combine` node over the `plus` of the leaves replaces the generate. N=8, k=2 gives 4 calls and one combine in
code. The leaves read the reduction's `instruction` when it is set (the reducer's leaf instruction), else the
query's own suffix; effects go into the combine's `plus` and run once.
"""

from __future__ import annotations

from spanq_integrations.optimizer.context import OptimizerContext
from spanq_integrations.query.errors import OptimizerError
from spanq_integrations.query.ir import Combine, Cross, Generate, Monad, Node, Plus, Print, User, transform

__all__ = ["tree_reduce"]


def tree_reduce(node: Node, ctx: OptimizerContext) -> Node:
    """Rewrite every generate over more than `ctx.tree_reduction.k` candidates into a tree of judges."""
    plan = ctx.tree_reduction
    if plan is None:
        return node
    combine = plan.reducer if plan.combine == "code" else None
    options = dict(plan.options)
    return transform(
        node, lambda n: _reduce(n, plan.k, plan.instruction, combine, options) if isinstance(n, Generate) else n
    )


def _is_effect(node: Node) -> bool:
    return isinstance(node, (Monad, Print))


def _split(judge_input: Node) -> tuple[tuple[Node, ...], Plus, tuple[Node, ...]] | None:
    """(prefix, candidates, suffix) of a judge's input; None when it has no single `plus` of candidates."""
    if isinstance(judge_input, Plus):
        return (), judge_input, ()
    if not isinstance(judge_input, Cross):
        return None
    pluses = [(i, c) for i, c in enumerate(judge_input.children) if isinstance(c, Plus)]
    if len(pluses) != 1:
        return None
    ((i, candidates),) = pluses
    return judge_input.children[:i], candidates, judge_input.children[i + 1 :]


def _reduce(
    g: Generate, k: int, instruction: str | None, combine: str | None, options: dict
) -> Generate | Combine:
    split = _split(g.input)
    if split is None:
        return g
    prefix, candidates_plus, suffix = split
    candidates = [c for c in candidates_plus.children if not _is_effect(c)]
    if len(candidates) <= k:
        return g

    judge_prefix = tuple(c for c in prefix if not _is_effect(c))
    if instruction is None:
        judge_suffix = tuple(c for c in suffix if not _is_effect(c))
    else:
        judge_suffix = (User(text=instruction),)
    keyword = g.input.keyword if isinstance(g.input, Cross) else "cross"

    def judge(group: list[Node], lone_passes: bool = True) -> Node:
        # A judge below the root answers once (n=1): the root's `n` is the query's choices; each level below
        # reads one answer from each judge under it (with n copied, k judges handed up k*n answers, and a
        # count combined in code counted each n times).
        if len(group) == 1 and lone_passes:
            return group[0]
        group_plus = candidates_plus.model_copy(update={"children": tuple(group)})
        if not judge_prefix and not judge_suffix:
            return g.model_copy(update={"input": group_plus, "n": 1})
        judge_input = Cross(children=(*judge_prefix, group_plus, *judge_suffix), keyword=keyword)
        return g.model_copy(update={"input": judge_input, "n": 1})

    if combine is not None:
        if g.n != 1:
            raise OptimizerError(f"a judge combined in code gives one verdict: it cannot give n={g.n} choices "
                                 "(combine in the model, or n=1)")  # fmt: skip
        every_effect = tuple(c for c in (*prefix, *candidates_plus.children, *suffix) if _is_effect(c))
        leaves = [judge(candidates[start : start + k], lone_passes=False) for start in range(0, len(candidates), k)]
        return Combine(input=Plus(children=(*every_effect, *leaves)), reducer=combine, options=options)

    level = candidates
    while len(level) > k:
        level = [judge(level[start : start + k]) for start in range(0, len(level), k)]

    effects = tuple(c for c in candidates_plus.children if _is_effect(c))
    root_input: Node = candidates_plus.model_copy(update={"children": (*effects, *level)})
    if isinstance(g.input, Cross):
        root_input = g.input.model_copy(update={"children": (*prefix, root_input, *suffix)})
    return g.model_copy(update={"input": root_input})
