"""What a chat model's settings do: LangChain's cache key holds every one that changes an answer."""

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

