"""Fixtures of the LangChain adapter tests: the chat model on the shared tiny backend, and a stock vLLM server."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")



@pytest.fixture
def chat(tiny_backend):
    from spanq_integrations.langchain import ChatSpanQuery

    return ChatSpanQuery(backend=tiny_backend, max_tokens=4, temperature=0)
