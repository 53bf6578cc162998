"""Bad input: no documents, a document longer than the context, unsupported messages, a server that is down."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from spanq_integrations import BackendUnavailableError, ContextLengthError
from spanq_integrations.langchain import (
    ChatSpanQuery,
    JudgeEnsemble,
    NoDocumentsError,
    UnsupportedMessageError,
    create_span_retrieval_chain,
)
from tests.langchain.rag_app import OrderedRetriever, format_docs, town_documents
from tests.servers import free_port

PROMPT = ChatPromptTemplate.from_messages([("system", "Context:\n{context}"), ("human", "{input}")])


@pytest.mark.vllm
def test_no_documents_retrieved_answers_from_an_empty_context(chat):
    empty = OrderedRetriever(documents=[], orders=[[]])
    app = {"context": empty | format_docs, "input": RunnablePassthrough()} | PROMPT | chat
    message = app.invoke("Anything?")
    assert isinstance(message.content, str)
    assert message.response_metadata["spanq"]["spans"] == 0
    assert message.response_metadata["spanq"]["fallback"] is None

    result = create_span_retrieval_chain(empty, PROMPT, chat).invoke({"input": "Anything?"})
    assert result["context"] == [] and isinstance(result["answer"], str)


def test_no_documents_can_be_an_error_instead():
    empty = OrderedRetriever(documents=[], orders=[[]])
    chain = create_span_retrieval_chain(
        empty, PROMPT, ChatSpanQuery(backend="http://127.0.0.1:9"), require_documents=True
    )
    with pytest.raises(NoDocumentsError, match="no documents"):
        chain.invoke({"input": "Anything?"})


@pytest.mark.vllm
def test_a_document_longer_than_the_context_names_the_document(chat):
    long_text = " ".join(f"Sentence {i} of the endless town chronicle." for i in range(600))
    docs = [*town_documents("long")[:1], Document(page_content=long_text, id="chronicle")]
    chain = create_span_retrieval_chain(OrderedRetriever(documents=docs, orders=[[0, 1]]), PROMPT, chat)
    with pytest.raises(ContextLengthError, match="document 'chronicle'.*split documents into smaller chunks"):
        chain.invoke({"input": "What happened?"})


def test_an_unsupported_message_type_is_refused_before_anything_is_sent():
    llm = ChatSpanQuery(backend="http://127.0.0.1:9")  # nothing listens there: the error comes first
    image = HumanMessage([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
    with pytest.raises(UnsupportedMessageError, match="text only"):
        llm.invoke([HumanMessage("hi"), image])
    with pytest.raises(ValueError, match="candidates"):
        JudgeEnsemble(llm=llm).invoke({"question": "q", "candidates": []})


@pytest.mark.parametrize("scheme", ["http", "spanq+http"])
def test_a_server_that_is_down_raises_backend_unavailable(scheme):
    url = f"{scheme}://127.0.0.1:{free_port()}"
    llm = ChatSpanQuery(backend=url, max_retries=0, timeout=10)
    with pytest.raises(BackendUnavailableError, match="cannot reach .* is the server running"):
        llm.invoke("Hello")
    llm.close()


@pytest.mark.vllm
def test_a_server_that_is_down_can_fall_back_to_the_embedded_engine(chat):
    down = ChatSpanQuery(backend=f"http://127.0.0.1:{free_port()}", max_retries=0)
    message = down.with_fallbacks([chat]).invoke("Hello")
    assert message.response_metadata["spanq"]["backend"] == "embedded"


@pytest.mark.vllm
def test_a_call_past_its_timeout_is_cancelled_and_the_engine_goes_on(chat):
    """The error is spanq's and a `TimeoutError` (what `with_retry(retry_if_exception_type=(TimeoutError,))` and
    asyncio's callers catch: it was only spanq's)."""
    slow = chat.model_copy(update={"timeout": 0.05, "max_tokens": 200})
    with pytest.raises(BackendUnavailableError, match="did not answer within timeout=0.05 s") as raised:
        slow.invoke("Tell me a long story.")
    assert isinstance(raised.value, TimeoutError)
    assert isinstance(chat.invoke("Hello").content, str)


def test_a_temperature_out_of_range_is_refused_when_the_model_is_made():
    """As max_tokens below 0 was: a temperature over 2 (what OpenAI-compatible servers take) is refused by
    ChatSpanQuery and LlamaIndex's SpanQueryLLM when they are made, not at the first call."""
    from pydantic import ValidationError

    from spanq_integrations.langchain import ChatSpanQuery
    from spanq_integrations.llamaindex import SpanQueryLLM

    for make in (ChatSpanQuery, SpanQueryLLM):
        with pytest.raises(ValidationError, match="temperature"):
            make(temperature=5)
        assert make(temperature=2).temperature == 2


@pytest.mark.vllm
def test_a_prompt_too_long_without_documents_does_not_blame_a_document(chat):
    with pytest.raises(ContextLengthError) as caught:
        chat.invoke("word " * 6000)
    assert "document" not in str(caught.value), caught.value


@pytest.mark.parametrize("wrong", ["one document as a string", Document(page_content="one document"), None, 7])
def test_format_docs_as_spans_names_a_wrong_argument_instead_of_splitting_it(wrong):
    """A string was split into one span per character, a single Document failed naming a tuple, None with
    Python's own message; each is now spanq's error (and a TypeError, as LangChain raises) naming the argument."""
    from spanq_integrations import SpanQueryError
    from spanq_integrations.langchain import format_docs_as_spans

    with pytest.raises(TypeError, match=r"format_docs_as_spans\(docs\): takes a list of Documents") as caught:
        format_docs_as_spans(wrong)
    assert isinstance(caught.value, SpanQueryError)
    with pytest.raises(TypeError, match=r"docs\[1\].*got int"):
        format_docs_as_spans(["fine", 3])
    assert [b["text"] for b in format_docs_as_spans(["a doc", Document(page_content="another")])] == [
        "a doc", "another"]  # fmt: skip


def test_judge_ensemble_input_errors_are_spanqs_own():
    from spanq_integrations import SpanQueryError

    judge = JudgeEnsemble(llm=ChatSpanQuery(backend="http://127.0.0.1:9"))
    for value, kind in (({"question": "q", "candidates": []}, ValueError), (None, TypeError),
                        ({"question": "q", "candidates": "one answer"}, TypeError), ({"question": " "}, ValueError),
                        ("", ValueError), ("  ", ValueError)):  # (a plain string ran on no question at all)
        with pytest.raises(kind) as caught:
            judge.invoke(value)
        assert isinstance(caught.value, SpanQueryError), caught.value


@pytest.mark.parametrize("cls_path", ["spanq_integrations.langchain:ChatSpanQuery",
                                      "spanq_integrations.langchain.llms:SpanQueryLLM",
                                      "spanq_integrations.llamaindex:SpanQueryLLM"])
def test_a_model_takes_chatopenais_model_name_and_refuses_a_parameter_it_does_not_know(cls_path):
    """Code ported from ChatOpenAI passes model_name=: it was dropped, and the call ran on the default model (a
    SmolLM2 engine started instead of tiny); a misspelt or foreign keyword was ignored the same way."""
    import importlib

    from pydantic import ValidationError

    module, name = cls_path.split(":")
    cls = getattr(importlib.import_module(module), name)
    backend = "http://127.0.0.1:9"
    assert cls(backend=backend, model_name="tiny").model == "tiny"
    assert cls(backend=backend, model="tiny", model_name="tiny").model == "tiny"
    with pytest.raises(ValidationError, match="name two models"):
        cls(backend=backend, model="a", model_name="b")
    with pytest.raises(ValidationError, match="has no parameter 'temprature' \\(did you mean 'temperature'\\?\\)"):
        cls(backend=backend, temprature=0)
    with pytest.raises(ValidationError, match="has no parameter 'base_url'"):
        cls(backend=backend, base_url="http://x")
    with pytest.raises(ValidationError, match="recompute must be a share between 0 and 1"):
        cls(backend=backend, recompute=2)
    with pytest.raises(ValidationError, match="max_retries"):
        cls(backend=backend, max_retries=-1)


@pytest.mark.vllm
@pytest.mark.parametrize("cls_path", ["spanq_integrations.langchain:ChatSpanQuery",
                                      "spanq_integrations.langchain.llms:SpanQueryLLM"])
def test_a_call_option_is_read_or_refused_by_name_and_a_stop_string_is_one_sequence(tiny_backend, cls_path):
    """Per call (`invoke(..., **options)`, `bind`), as ChatOpenAI reads them: a string `stop` is one stop sequence
    (each of its characters stopped the answer: "fz" cut " afforded" to " a"); `max_completion_tokens` is
    `max_tokens`; an option the model does not read is refused by name (`top_p` ran as if not given)."""
    import importlib

    from spanq_integrations.query.errors import ArgumentTypeError, ArgumentValueError

    module, name = cls_path.split(":")
    llm = getattr(importlib.import_module(module), name)(backend=tiny_backend, max_tokens=8, temperature=0)

    def text(answer):
        return answer if isinstance(answer, str) else answer.content

    whole = text(llm.invoke("hi"))
    stop = whole.strip()[0] + "\u00a7\u00a4"  # its first character is in the answer, the sequence is not
    assert text(llm.invoke("hi", stop=stop)) == whole, "a string stop was read as its characters"
    assert text(llm.bind(stop=stop).invoke("hi")) == whole
    assert text(llm.invoke("hi", stop=[whole.strip()[:3]])) != whole  # a stop that occurs still stops it
    with pytest.raises(ArgumentTypeError, match="stop sequences are a string or a list of strings"):
        llm.invoke("hi", stop=[1])
    if name == "ChatSpanQuery":
        assert llm.bind(max_completion_tokens=1).invoke("hi").usage_metadata["output_tokens"] == 1
    with pytest.raises(ArgumentValueError, match="max_completion_tokens=1.*and max_tokens=2 say two things"):
        llm.invoke("hi", max_completion_tokens=1, max_tokens=2)
    with pytest.raises(ArgumentValueError, match="not an option of a call: 'top_p'"):
        llm.invoke("hi", top_p=0.1)
    with pytest.raises(ArgumentValueError, match="'temprature' \\(did you mean 'temperature'\\?\\)"):
        llm.bind(temprature=0).invoke("hi")


@pytest.mark.vllm
def test_tokens_are_counted_by_the_models_own_tokenizer_and_trim_messages_trims(chat, stock_vllm_server):
    """LangChain's default counts GPT-2 tokens, downloaded on first use: offline, every text counted 0 tokens and
    `trim_messages(token_counter=llm)` kept everything. The embedded engine counts by its tokenizer, a vLLM server
    by its `/tokenize`; a server without one falls back to LangChain's count."""
    from langchain_core.messages import AIMessage, trim_messages

    from spanq_integrations.langchain import ChatSpanQuery

    tokenizer = chat._get_backend().engine.tokenizer
    text = "The ferry to Lindale leaves at noon from the harbour."
    expected = len(tokenizer.encode(text, add_special_tokens=False))
    assert expected > 5 and chat.get_num_tokens(text) == expected
    served = ChatSpanQuery(backend=f"{stock_vllm_server}/v1", model="tiny")
    assert served.get_num_tokens(text) == expected, "the server's own tokenizer (the same model)"
    history = [HumanMessage(f"Question {i}: " + text) for i in range(6)] + [AIMessage("An answer.")]
    kept = trim_messages(history, max_tokens=3 * (expected + 12), token_counter=chat, strategy="last")
    assert 1 <= len(kept) < len(history), len(kept)
    served.close()
