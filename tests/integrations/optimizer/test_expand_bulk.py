"""Bulk expansion: repeat and map become order-free batches of generate calls."""

from __future__ import annotations

from spanq_integrations.optimizer import OptimizerContext, expand_bulk
from spanq_integrations.query.ir import Generate, Map, Plus, Repeat, User


def test_repeat_becomes_n_distinct_copies() -> None:
    g = Generate(input=User(text="write an email"), model="m", temperature=0.9)
    result = expand_bulk(Repeat(n=3, query=g), OptimizerContext())
    assert result == Plus(children=(g, g, g))
    assert len({id(c) for c in result.children}) == 3


def test_map_becomes_one_generate_per_input() -> None:
    m = Map(inputs=("a", "b"), model="m", max_tokens=5, temperature=0.0)
    assert expand_bulk(m, OptimizerContext()) == Plus(
        children=(
            Generate(input=User(text="a"), model="m", max_tokens=5, temperature=0.0),
            Generate(input=User(text="b"), model="m", max_tokens=5, temperature=0.0),
        )
    )


def test_map_without_inputs_is_an_empty_batch() -> None:
    assert expand_bulk(Map(inputs=()), OptimizerContext()) == Plus(children=())


def test_bulk_inside_a_judge_is_expanded_in_place() -> None:
    g = Generate(input=User(text="candidate"))
    judge = Generate(input=Plus(children=(Repeat(n=2, query=g),)), model="judge")
    assert expand_bulk(judge, OptimizerContext()) == Generate(
        input=Plus(children=(Plus(children=(g, g)),)), model="judge"
    )
