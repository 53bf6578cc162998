"""Rule 1: a chat turn becomes the generate call over its messages."""

from __future__ import annotations

from spanq_integrations.optimizer import OptimizerContext, desugar_chat
from spanq_integrations.query.ir import Chat, Cross, Fragment, Generate, Plus, System, User


def test_chat_becomes_generate_over_cross_of_messages() -> None:
    messages = (System(text="be brief"), User(text="hi"))
    chat = Chat(messages=messages, model="m", max_tokens=7, temperature=0.1)
    assert desugar_chat(chat, OptimizerContext()) == Generate(
        input=Cross(children=messages), model="m", max_tokens=7, temperature=0.1
    )


def test_nested_chats_are_lowered_too() -> None:
    inner = Chat(messages=(User(text="draft"),))
    outer = Chat(messages=(System(text="judge"), Plus(children=(inner, Fragment(text="f")))))
    assert desugar_chat(outer, OptimizerContext()) == Generate(
        input=Cross(
            children=(
                System(text="judge"),
                Plus(children=(Generate(input=Cross(children=(User(text="draft"),))), Fragment(text="f"))),
            )
        )
    )


def test_a_tree_without_chats_is_returned_as_is() -> None:
    q = Generate(input=Cross(children=(System(text="s"), User(text="u"))))
    assert desugar_chat(q, OptimizerContext()) is q
