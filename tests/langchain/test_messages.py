"""LangChain messages → the span query's input, and cutting a prompt around documents found in it."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import (
    AIMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from spanq_integrations import Assistant, Cross, Fragment, Plus, System, User
from spanq_integrations.langchain import UnsupportedMessageError, format_docs_as_spans, span_block
from spanq_integrations.langchain.messages import (
    PromptMessage,
    SpanCandidate,
    SpanPiece,
    prompt_from_messages,
    query_input,
    split_at_documents,
)
from spanq_integrations.query.flatten import to_chat_messages


def test_roles_map_to_the_ir_messages():
    prompt = prompt_from_messages(
        [
            SystemMessage("be brief"),
            HumanMessage("hi"),
            AIMessage("hello"),
            ChatMessage(role="user", content="and?"),
        ]
    )
    node = query_input(prompt, span_aware=True)
    assert node == Cross(
        children=(System(text="be brief"), User(text="hi"), Assistant(text="hello"), User(text="and?"))
    )


def test_adjacent_span_blocks_become_one_plus_of_fragments():
    spans = format_docs_as_spans(["doc A", "doc B"])
    message = HumanMessage(["Context:", *spans, {"type": "text", "text": "Question: which?"}])
    node = query_input(prompt_from_messages([SystemMessage("sys"), message]), span_aware=True)
    assert isinstance(node, Cross)
    system, before, plus, after = node.children
    assert (system, before, after) == (
        System(text="sys"),
        User(text="Context:"),
        User(text="Question: which?"),
    )
    assert isinstance(plus, Plus)
    assert [f.text for f in plus.children] == ["doc A", "doc B"]
    assert all(isinstance(f, Fragment) and f.id for f in plus.children)


def test_a_text_block_between_span_blocks_starts_a_new_plus():
    message = HumanMessage([span_block("a"), span_block("b"), "then", span_block("c"), span_block("d")])
    node = query_input(prompt_from_messages([message]), span_aware=True)
    kinds = [type(c).__name__ for c in node.children]
    assert kinds == ["Plus", "User", "Plus"]


def test_spans_are_flattened_into_their_message_for_an_ordinary_server():
    message = HumanMessage(["Context:", *format_docs_as_spans(["doc A", "doc B"]), "Question: which?"])
    node = query_input(prompt_from_messages([SystemMessage("sys"), message]), span_aware=False)
    assert not any(isinstance(c, Plus) for c in node.children)
    sent = to_chat_messages(node)
    assert sent == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Context:\n\ndoc A\n\ndoc B\n\nQuestion: which?"},
    ]
    assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in sent)


@pytest.mark.parametrize("found", [False, True], ids=["span blocks", "found in the text"])
def test_documents_in_the_system_prompt_stay_in_the_system_message(found):
    """LangChain's RAG template puts the context in its system message: the span engine's prompt keeps it there,
    as the stock prompt has it (before, the documents became a user turn of their own)."""
    from langchain_core.prompts import ChatPromptTemplate

    texts = ["Doc one is about boats.", "Doc two is about apples."]
    if found:  # the template's string, documents found in it as the adapters find a chain's retrieved ones
        template = ChatPromptTemplate.from_messages(
            [("system", "Answer from the context.\n\nContext:\n{context}\n\nBe brief."), ("human", "{question}")]
        )
        messages = template.invoke({"context": "\n\n".join(texts), "question": "Which?"}).to_messages()
        prompt, reason = split_at_documents(prompt_from_messages(messages), [SpanCandidate(t) for t in texts])
        assert reason is None and prompt is not None
    else:
        system = SystemMessage(["Answer from the context.\n\nContext:", *format_docs_as_spans(texts), "Be brief."])
        prompt = prompt_from_messages([system, HumanMessage("Which?")])
    spans = query_input(prompt, span_aware=True)
    plain = to_chat_messages(query_input(prompt, span_aware=False))
    sent = to_chat_messages(spans)
    assert [" ".join(m["content"].split()) for m in sent] == [" ".join(m["content"].split()) for m in plain]
    assert [m["role"] for m in sent] == [m["role"] for m in plain] == ["system", "user"]
    (group,) = [c for c in spans.children if isinstance(c, Plus)]
    assert group.role == "system" and [f.text for f in group.children] == texts


def test_the_shorthand_marker_is_read_too():
    message = HumanMessage([{"type": "text", "text": "doc", "spanq": {"span": True, "id": "d1"}}])
    (m,) = prompt_from_messages([message])
    assert m.parts == [SpanPiece("doc", "d1")]


@pytest.mark.parametrize(
    "message, words",
    [
        (FunctionMessage("42", name="f"), "FunctionMessage"),
        (HumanMessage([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]), "text only"),
        (ChatMessage(role="critic", content="meh"), "role 'critic'"),
    ],
)
def test_unsupported_messages_raise_a_clear_error(message, words):
    with pytest.raises(UnsupportedMessageError, match=words) as caught:
        prompt_from_messages([HumanMessage("hi"), message])
    assert caught.value.path.startswith("messages[1]")


def test_tool_calls_and_results_in_the_history_are_written_as_the_model_writes_them():
    """An agent's transcript: the model's call is JSON as it wrote it; the result is a user turn naming its call."""
    history = [
        HumanMessage("What is 3 plus 4?"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 3, "b": 4}, "id": "c1"}]),
        ToolMessage("7", tool_call_id="c1"),
        ToolMessage("boom", tool_call_id="c2", name="other", status="error"),
    ]
    prompt = prompt_from_messages(history)
    assert [m.role for m in prompt] == ["user", "assistant", "user", "user"]
    assert json.loads(prompt[1].parts[-1]) == {"tool_calls": [{"name": "add", "arguments": {"a": 3, "b": 4}}]}
    assert "".join(prompt[2].parts) == "Result of add, call c1:\n7"
    assert "".join(prompt[3].parts).startswith("Result of other, call c2 (it failed):")


# --------------------------------------------------------------------------------------------- documents

DOCS = [SpanCandidate("Doc one is about boats.", "one"), SpanCandidate("Doc two is about apples.", "two")]


def _prompt(system_text: str, question: str = "Which?") -> list[PromptMessage]:
    return [PromptMessage("system", [system_text]), PromptMessage("user", [question])]


def test_documents_joined_by_blank_lines_are_cut_out_as_spans():
    prompt = _prompt("Use the context.\n\nContext:\nDoc two is about apples.\n\nDoc one is about boats.\n")
    split, reason = split_at_documents(prompt, DOCS)
    assert reason is None
    assert split[0].parts == [
        "Use the context.\n\nContext:",
        SpanPiece("Doc two is about apples.", "two"),
        SpanPiece("Doc one is about boats.", "one"),
    ]
    assert split[1].parts == ["Which?"]


def test_documents_missing_from_the_prompt_are_ignored():
    split, reason = split_at_documents(_prompt("Context:\nDoc one is about boats."), DOCS)
    assert reason is None and split[0].parts[1:] == [SpanPiece("Doc one is about boats.", "one")]


@pytest.mark.parametrize(
    "system_text, question, words",
    [
        ("Context:\n[1] Doc one is about boats.\n[2] Doc two is about apples.", "Which?", "text other than"),
        ("Doc one is about boats. Doc one is about boats.", "Which?", "appears 2 times"),
        ("Context:\n[1] Doc one is about boats.\n\nNote: [2] Doc two is about apples.", "Which?", "text other than"),
        ("Context: see Doc one is about boats. and more", "Which?", "line boundaries"),
        ("Context: (nothing retrieved)", "Which?", "none of the 2"),
    ],
)
def test_unsafe_layouts_fall_back_to_the_plain_prompt_with_a_reason(system_text, question, words):
    split, reason = split_at_documents(_prompt(system_text, question), DOCS)
    assert split is None
    assert words in reason


def test_documents_in_several_messages_form_a_group_each_and_may_repeat_across_groups():
    """An agent's transcript: each step's tool results in a message of their own, a document read again."""
    prompt = [
        PromptMessage("system", ["Use the tools."]),
        PromptMessage("user", ["Results:\nDoc one is about boats.\n"]),
        PromptMessage("assistant", ["Doc one is about boats. Searching again."]),
        PromptMessage("user", [("More results:\nDoc two is about apples.\n\nDoc one is about boats.\nThen:\n"
                                "Doc two is about apples.\nWhich?")]),
    ]
    split, reason = split_at_documents(prompt, DOCS)
    assert reason is None
    one, two = SpanPiece("Doc one is about boats.", "one"), SpanPiece("Doc two is about apples.", "two")
    assert split[1].parts == ["Results:", one]
    assert split[2].parts == prompt[2].parts, "an assistant's words are never cut"
    assert split[3].parts == ["More results:", two, one, "Then:", two, "Which?"]


def test_a_document_inside_a_longer_one_does_not_count_twice():
    long = SpanCandidate("Header. Doc one is about boats. Footer.", "long")
    split, reason = split_at_documents(
        _prompt("Context:\nHeader. Doc one is about boats. Footer."), [*DOCS, long]
    )
    assert reason is None
    assert split[0].parts[1:] == [SpanPiece(long.text, "long")]


def test_nothing_to_look_for_is_not_a_fallback():
    assert split_at_documents(_prompt("Context:"), []) == (None, None)


@pytest.mark.vllm
def test_a_chat_model_naming_its_model_runs_on_that_model_embedded(tiny_model):
    """`ChatSpanQuery(model="tiny")` on the embedded backend runs the tiny model, not the default one."""
    from spanq_backend.serving.embedded import shared_embedded_backend
    from spanq_integrations.langchain import ChatSpanQuery

    try:
        reply = ChatSpanQuery(model="tiny", max_tokens=2, temperature=0).invoke("hi")
        assert reply.response_metadata["model_name"] == tiny_model.name
        backend = shared_embedded_backend("tiny")
        assert backend.engine.model_path == tiny_model
        assert shared_embedded_backend(tiny_model.name) is backend  # its served name finds the same engine
    finally:
        shared_embedded_backend("tiny").shutdown()


@pytest.mark.vllm
def test_a_call_naming_a_model_the_embedded_engine_does_not_run_says_so(tiny_backend, monkeypatch):
    import logging

    from spanq_integrations.langchain import ChatSpanQuery

    seen: list[str] = []
    monkeypatch.setattr(logging.getLogger("spanq.embedded"), "warning", lambda msg, *a: seen.append(msg % a))
    chat = ChatSpanQuery(backend=tiny_backend, max_tokens=2, temperature=0)
    chat.invoke("hi", model="Qwen/Qwen3-8B")
    chat.invoke("hi", model="Qwen/Qwen3-8B")
    chat.invoke("hi", model=tiny_backend.model_name)
    assert len(seen) == 1, "said once per model name, never for the engine's own"
    assert "'Qwen/Qwen3-8B'" in seen[0] and tiny_backend.model_name in seen[0]
