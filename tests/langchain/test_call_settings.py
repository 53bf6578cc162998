"""What a chat model's settings do: LangChain's cache key holds every one that changes an answer; the finish
reason is the engine's, not a guess."""

from __future__ import annotations

import pytest
from langchain_core.caches import InMemoryCache
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage

from spanq_integrations.langchain import ChatSpanQuery, format_docs_as_spans

DOCS = [Document(page_content=f"Town {c} has a {c.lower()}-painted town hall.") for c in ("Red", "Blue", "Green")]


def _prompt():
    return [HumanMessage([*format_docs_as_spans(DOCS), "Which town hall is blue?"])]


@pytest.mark.vllm
@pytest.mark.parametrize(
    "setting",
    [{"recompute": "first"}, {"span_anchor": "prefix"}, {"recover_documents": "off"}],
    ids=lambda s: next(iter(s)),
)
def test_models_that_differ_only_in_how_spans_are_computed_do_not_share_cached_answers(tiny_backend, setting):
    cache = InMemoryCache()
    plain = ChatSpanQuery(backend=tiny_backend, max_tokens=3, temperature=0, cache=cache)
    other = ChatSpanQuery(backend=tiny_backend, max_tokens=3, temperature=0, cache=cache, **setting)
    plain.invoke(_prompt())
    second = other.invoke(_prompt())
    # The second model computes its own answer, under its own cache entry; with a shared key it would have been
    # handed the first model's answer from the cache.
    assert len(cache._cache) == 2
    # ... while the same settings do share one: the cache is in use at all.
    again = ChatSpanQuery(backend=tiny_backend, max_tokens=3, temperature=0, cache=cache, **setting).invoke(_prompt())
    assert len(cache._cache) == 2 and again.content == second.content


@pytest.mark.vllm
def test_models_on_backend_objects_that_answer_differently_do_not_share_cached_answers(tiny_backend, compact_tiny):
    """A `Backend` object was keyed by its class alone: two embedded engines (on two models, or one with compact
    JSON) and two servers' models shared LangChain's cached answers."""
    from spanq_integrations.backends.openai import OpenAIBackend

    def key(backend) -> str:
        return ChatSpanQuery(backend=backend, max_tokens=3, temperature=0)._get_llm_string()

    assert key(tiny_backend) != key(compact_tiny)
    assert "compact_json=True" in compact_tiny.identity and "model=" in tiny_backend.identity
    on_a, on_b = (OpenAIBackend("http://127.0.0.1:9/v1", model=m) for m in ("model-a", "model-b"))
    assert key(on_a) != key(on_b) and key(on_a) == key(OpenAIBackend("http://127.0.0.1:9/v1", model="model-a"))
    assert key(tiny_backend) == key(tiny_backend)  # (the same in every process: no object ids)
    assert " at 0x" not in key(tiny_backend) + key(on_a)


@pytest.mark.vllm
def test_the_finish_reason_is_the_engines(tiny_backend):
    # max_tokens unset: the engine's own default (256) ends the random model's answer. A reason guessed from
    # max_tokens said "stop" here.
    unset = ChatSpanQuery(backend=tiny_backend, temperature=0).invoke("Count to a thousand.")
    assert unset.response_metadata["finish_reason"] == "length"
    assert unset.usage_metadata["output_tokens"] == 256
    capped = ChatSpanQuery(backend=tiny_backend, temperature=0, max_tokens=3).invoke("Count to a thousand.")
    assert capped.response_metadata["finish_reason"] == "length"


@pytest.mark.vllm
def test_an_answer_that_ends_itself_finishes_with_stop(compact_tiny):
    from pydantic import BaseModel

    class Flag(BaseModel):
        ok: bool

    # Constrained to a closed JSON object, the answer ends when the object does, well before max_tokens.
    raw = ChatSpanQuery(backend=compact_tiny, temperature=0, max_tokens=64).with_structured_output(
        Flag, include_raw=True
    ).invoke("Is the sky blue?")
    assert raw["parsed"] is not None
    assert raw["raw"].response_metadata["finish_reason"] == "stop"
    assert raw["raw"].usage_metadata["output_tokens"] < 64


@pytest.mark.vllm
def test_generate_over_several_prompts_sums_their_token_usage_in_llm_output(tiny_backend):
    """As ChatOpenAI does: `generate(...).llm_output["token_usage"]` sums the prompts' (it was {} for the chat
    model: BaseChatModel's own combine returns nothing)."""
    llm = ChatSpanQuery(backend=tiny_backend, max_tokens=3, temperature=0)
    result = llm.generate([[HumanMessage("Name a town.")], [HumanMessage("Name a colour, please.")]])
    usages = [g[0].message.usage_metadata for g in result.generations]
    usage = result.llm_output["token_usage"]
    assert usage["prompt_tokens"] == sum(u["input_tokens"] for u in usages) > 0
    assert usage["completion_tokens"] == sum(u["output_tokens"] for u in usages) > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert result.llm_output["model_name"] == result.generations[0][0].message.response_metadata["model_name"]
