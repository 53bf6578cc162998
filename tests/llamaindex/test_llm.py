"""SpanQueryLLM: chat and completion, sync and async, streaming, metadata, instrumentation, backends, errors."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock

from spanq_integrations import Assistant, BackendUnavailableError, Cross, QueryValidationError, SpanQueryError
from spanq_integrations.llamaindex import SpanQueryLLM, messages_to_nodes
from spanq_integrations.query.ir import System, User
from tests.servers import free_port

CONVERSATION = [
    ChatMessage(role=MessageRole.SYSTEM, content="You answer in one word."),
    ChatMessage(role=MessageRole.USER, content="Name a colour."),
    ChatMessage(role=MessageRole.ASSISTANT, content="Blue."),
    ChatMessage(role=MessageRole.USER, content="Another one."),
]
USAGE_KEYS = {
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "padded_tokens",
    "prepared_spans",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
    "ttft_s",
}


# --------------------------------------------------------------------------------------------- no engine


def test_roles_map_to_span_query_messages():
    nodes = messages_to_nodes(
        [
            *CONVERSATION,
            ChatMessage(role=MessageRole.DEVELOPER, content="d"),
            ChatMessage(role="model", content="m"),
        ]
    )
    assert [type(n) for n in nodes] == [System, User, Assistant, User, System, Assistant]
    assert [n.text for n in nodes[:4]] == [
        "You answer in one word.",
        "Name a colour.",
        "Blue.",
        "Another one.",
    ]


def test_chat_is_one_generate_over_the_messages_in_order():
    llm = SpanQueryLLM(max_tokens=7, temperature=0.3)
    query = llm.chat_query(CONVERSATION, max_tokens=3, stop=["\n"], top_k=5)  # an option it does not use
    assert isinstance(query.input, Cross)
    assert [type(c) for c in query.input.children] == [System, User, Assistant, User]
    assert (query.max_tokens, query.temperature, query.stop) == (3, 0.3, ("\n",))
    assert llm.completion_query("hi").input.children == (User(text="hi"),)
    for bad in (0, -1, 2.5, "3"):  # a Generate's 0 would mean the server's default: up to the whole window
        with pytest.raises(ValueError, match=rf"max_tokens must be a whole number of at least 1, got {bad!r}"):
            llm.chat_query(CONVERSATION, max_tokens=bad)
    assert llm.chat_query(CONVERSATION, max_tokens=5.0).max_tokens == 5  # (as int() read it before)


@pytest.mark.parametrize(
    "message, problem",
    [
        (ChatMessage(role=MessageRole.CHATBOT, content="hi"), None),
        (
            ChatMessage(
                role=MessageRole.USER, blocks=[TextBlock(text="see"), ImageBlock(url="http://x/y.png")]
            ),
            "text only",
        ),
    ],
)
def test_messages_it_cannot_send_are_refused_with_their_index(message, problem):
    if problem is None:  # sent: an assistant role by another name
        assert isinstance(messages_to_nodes([CONVERSATION[1], message])[1], Assistant)
        return
    with pytest.raises(QueryValidationError, match=rf"messages\[1\].*{problem}"):
        messages_to_nodes([CONVERSATION[1], message])
    with pytest.raises(QueryValidationError, match="at least one message"):
        messages_to_nodes([])


def test_metadata_without_starting_an_engine():
    llm = SpanQueryLLM(max_tokens=99)
    meta = llm.metadata
    assert (meta.context_window, meta.num_output, meta.is_chat_model, meta.is_function_calling_model) == (
        4096,
        99,
        True,
        True,  # tool calls through constrained decoding (test_llamaindex_tools.py)
    )
    assert SpanQueryLLM(model="tiny", context_window=1234).metadata.model_name == "tiny"
    assert SpanQueryLLM(model="tiny", context_window=1234).metadata.context_window == 1234


def test_an_unknown_backend_is_refused_at_once():
    with pytest.raises(SpanQueryError, match="unknown backend 'localhost:8000'.*http"):
        SpanQueryLLM(backend="localhost:8000")


@pytest.mark.parametrize("scheme", ["http", "spanq+http"])
def test_server_down_raises_backend_unavailable(scheme):
    llm = SpanQueryLLM(backend=f"{scheme}://127.0.0.1:{free_port()}", max_retries=0, timeout=5)
    with pytest.raises(BackendUnavailableError, match="cannot reach .* is the server running"):
        llm.complete("hello")
    llm.close()


# --------------------------------------------------------------------------------------------- tiny engine


@pytest.mark.vllm
def test_metadata_reports_the_running_engine(span_llm, tiny_backend):
    span_llm.get_backend()
    assert span_llm.metadata.context_window == tiny_backend.engine.max_model_len == 2048
    assert span_llm.metadata.model_name == tiny_backend.model_name


@pytest.mark.vllm
def test_chat_and_complete_report_usage(span_llm):
    chat = span_llm.chat(CONVERSATION)
    assert chat.message.role == MessageRole.ASSISTANT and chat.message.content
    assert USAGE_KEYS <= set(chat.additional_kwargs)
    assert chat.additional_kwargs["completion_tokens"] == 6
    assert chat.raw["spanq"]["calls"] == 1
    again = span_llm.chat(CONVERSATION)
    assert again.message.content == chat.message.content  # greedy (the fixture asks temperature 0)
    assert again.additional_kwargs["cached_tokens"] > 0  # the same prompt: its full blocks are cached

    completion = span_llm.complete("Name a colour.", max_tokens=3)
    assert completion.text and completion.additional_kwargs["completion_tokens"] == 3
    # Why the answers ended, as the engine said: both were cut at max_tokens.
    assert chat.additional_kwargs["finish_reason"] == completion.additional_kwargs["finish_reason"] == "length"
    assert chat.raw["finish_reason"] == "length"


@pytest.mark.vllm
def test_run_query_runs_what_execute_runs(span_llm, tiny_backend):
    """`run_query` takes any span query `execute` takes, sugar included (`chat` is lowered first)."""
    from spanq_integrations import chat, execute, system, user

    query = chat(system("You answer in one word."), user("Name a colour."), max_tokens=4, temperature=0)
    result = span_llm.run_query(query)
    assert result.answer == execute(query, tiny_backend).answer and len(result.calls) == 1


@pytest.mark.vllm
def test_usage_says_what_was_read_from_and_written_to_the_cache_in_the_frameworks_names(span_llm, tiny_backend):
    """#33 item 3: `cache_creation_input_tokens` is what a call prepared as spans, `cache_read_input_tokens` what it
    read from the KV cache (the names LlamaIndex's Anthropic LLM uses), and `raw["usage"]` is OpenAI's shape."""
    from spanq_integrations import cross, fragment, generate, plus, system, user

    docs = [f"Shelf {c} holds {n} jars of plum jam and a ledger." * 6 for c, n in zip("PQR", (3, 5, 8))]

    def ask(order):
        return generate(
            cross(system("Answer from the shelves."), plus(*[fragment(docs[i]) for i in order]), user("Which shelf?")),
            max_tokens=2, temperature=0.0, cold_spans="isolate",
        )

    cold, warm = (SpanQueryLLM._usage_fields(span_llm.run_query(ask(order))) for order in ((0, 1, 2), (2, 0, 1)))
    (cold_kw, cold_raw), (warm_kw, warm_raw) = cold, warm
    assert cold_kw["cache_creation_input_tokens"] == cold_raw["spanq"]["prepared_tokens"] > 0
    assert warm_kw["cache_creation_input_tokens"] == 0, "the reordered shelves were all cached"
    # the warm call reads back the shelves the cold one wrote (the anchor it also wrote is not in the prompt)
    assert warm_kw["cache_read_input_tokens"] == warm_kw["cached_tokens"] > cold_kw["cache_read_input_tokens"]
    assert warm_raw["usage"]["prompt_tokens_details"]["cached_tokens"] == warm_kw["cached_tokens"]
    assert warm_raw["usage"]["prompt_tokens"] == warm_kw["prompt_tokens"]


@pytest.mark.vllm
def test_streaming_chat_and_completion(span_llm):
    full = span_llm.chat(CONVERSATION).message.content
    chunks = list(span_llm.stream_chat(CONVERSATION))
    assert "".join(c.delta for c in chunks) == full
    assert chunks[-1].message.content == full and chunks[-1].delta == ""
    assert chunks[-1].additional_kwargs["completion_tokens"] == 6
    assert len([c for c in chunks if c.delta]) > 1

    pieces = list(span_llm.stream_complete("Name a colour."))
    assert pieces[-1].text == "".join(p.delta for p in pieces) == span_llm.complete("Name a colour.").text


@pytest.mark.vllm
async def test_async_chat_completion_and_streams(span_llm):
    full = (await span_llm.achat(CONVERSATION)).message.content
    assert full == span_llm.chat(CONVERSATION).message.content
    chunks = [c async for c in await span_llm.astream_chat(CONVERSATION)]
    assert "".join(c.delta for c in chunks) == full
    assert chunks[-1].additional_kwargs["completion_tokens"] == 6

    completion = await span_llm.acomplete("Name a colour.")
    pieces = [p async for p in await span_llm.astream_complete("Name a colour.")]
    assert pieces[-1].text == completion.text


@pytest.mark.vllm
async def test_an_llm_whose_backend_starts_slowly_holds_no_other_llms_stream_up(tiny_backend):
    """The first call of an LLM starts its backend (the embedded engine: seconds). Other LLMs' streams run on
    the same background loop meanwhile: the start must not run on it (nor on the caller's loop). The slow
    start is stood in for by a delay before this LLM's backend is handed over."""
    import asyncio
    import itertools
    import time

    class SlowStart(SpanQueryLLM):
        def _open_backend(self):
            time.sleep(1.5)
            return tiny_backend, False

    streaming = SpanQueryLLM(backend=tiny_backend, max_tokens=120, temperature=0.0)
    arrivals: list[float] = []
    stream = await streaming.astream_complete("Count from one to a hundred.")
    first = await anext(stream)
    arrivals.append(time.monotonic())
    starting = asyncio.create_task(SlowStart(backend=tiny_backend, max_tokens=2).acomplete("Hi."))
    async for _ in stream:
        arrivals.append(time.monotonic())
    assert (await starting).text is not None and first.delta
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert len(gaps) > 20 and max(gaps) < 0.75, f"a gap of {max(gaps):.2f} s between pieces of another LLM's stream"


@pytest.mark.vllm
def test_predict_uses_the_chat_path(span_llm):
    from llama_index.core.prompts import PromptTemplate

    assert span_llm.predict(PromptTemplate("Say {word}."), word="hi")


@pytest.mark.vllm
async def test_instrumentation_events(span_llm, events):
    span_llm.chat(CONVERSATION)
    assert events.names() == ["LLMChatStartEvent", "LLMChatEndEvent"]
    end = events.events[-1]
    assert end.response.additional_kwargs["completion_tokens"] == 6
    assert [m.content for m in events.events[0].messages] == [m.content for m in CONVERSATION]

    events.events.clear()
    list(span_llm.stream_complete("Name a colour."))
    names = events.names()
    assert names[0] == "LLMCompletionStartEvent" and names[-1] == "LLMCompletionEndEvent"
    assert "LLMCompletionInProgressEvent" in names

    events.events.clear()
    async for _ in await span_llm.astream_chat(CONVERSATION):
        pass
    names = events.names()
    assert names[0] == "LLMChatStartEvent" and names[-1] == "LLMChatEndEvent"
    assert "LLMChatInProgressEvent" in names


@pytest.mark.vllm
def test_an_over_long_prompt_is_a_context_length_error(span_llm):
    from spanq_integrations import ContextLengthError

    with pytest.raises(ContextLengthError, match="context window is 2048 tokens"):
        span_llm.complete("word " * 3000)


@pytest.mark.vllm
@pytest.mark.slow
def test_any_openai_compatible_server(stock_vllm_server):
    llm = SpanQueryLLM(backend=stock_vllm_server, max_tokens=5, temperature=0.0)
    try:
        chat = llm.chat(CONVERSATION)
        assert chat.additional_kwargs["completion_tokens"] == 5
        assert chat.additional_kwargs["padded_tokens"] == 0  # no spans on a stock server
        streamed = list(llm.stream_chat(CONVERSATION))
        assert "".join(c.delta for c in streamed) == chat.message.content
        # the server's model once it answered (it said "spanq-server-default" whatever the server served)
        assert llm.metadata.model_name == "tiny"
    finally:
        llm.close()


@pytest.mark.vllm
def test_an_llm_naming_its_model_runs_on_that_model_embedded(tiny_model):
    """`SpanQueryLLM(model="tiny")` on the embedded backend runs the tiny model, not the default one."""
    from spanq_backend.serving.embedded import shared_embedded_backend
    from spanq_integrations.llamaindex.usage import METADATA_KEY

    try:
        response = SpanQueryLLM(model="tiny", max_tokens=2, temperature=0.0).complete("hi")
        assert response.raw[METADATA_KEY]["model"] == tiny_model.name
    finally:
        shared_embedded_backend("tiny").shutdown()
