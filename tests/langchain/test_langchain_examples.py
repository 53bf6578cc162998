"""The LangChain examples run: the RAG script on the session's tiny engine, the notebook as a user runs it (its
own kernel, the embedded default model SmolLM2)."""

from __future__ import annotations

import pytest

from spanq_integrations.langchain import ChatSpanQuery
from tests.examples import load_example

pytestmark = pytest.mark.vllm


def test_rag_script_reuses_the_reordered_documents(tiny_backend):
    example = load_example("examples/rag/langchain_rag.py")
    llm = ChatSpanQuery(backend=tiny_backend, max_tokens=4, temperature=0)
    docs = example.load_documents(4)
    rows = example.run(llm, docs, k=4)
    assert [r["chain"] for r in rows] == ["unchanged"] * 2 + ["one line"] * 2 + ["drop-in"] * 2
    for first, second in zip(rows[::2], rows[1::2]):
        assert first["order"] != second["order"] and sorted(first["order"]) == sorted(second["order"])
        assert first["spans"] == second["spans"] == 4
        assert second["prepared"] == 0 and second["cached"] >= second["prompt"] // 2


@pytest.mark.slow
def test_notebook_runs_on_the_embedded_default(notebook_kernel):
    outputs = notebook_kernel.run("examples/rag/langchain_rag.ipynb", SPANQ_EXAMPLE_MAX_TOKENS="8")
    assert "4 spans, 0 computed now" in outputs  # the second question: every document from the span cache
    assert "from the span cache, with its 4 documents in a new order" in outputs
    assert "fallback: text other than whitespace" in outputs



def test_agent_script_searches_reuses_the_found_documents_and_judges(compact_tiny):
    example = load_example("examples/judge/langchain_agent.py")
    llm = ChatSpanQuery(backend=compact_tiny, max_tokens=80, temperature=0.5)
    judge_llm = ChatSpanQuery(backend=compact_tiny, max_tokens=8, temperature=0)
    result = example.run(llm, judge_llm, n=3)
    runs = result["runs"]
    assert all(len(r["searched"]) == 1 for r in runs), "every agent called the search tool once"
    answers = [r["calls"][-1] for r in runs]
    assert all(a["spans"] == 3 for a in answers), "the tool's documents were read as spans"
    assert answers[0]["prepared_spans"] == 3 and answers[1]["prepared_spans"] == answers[2]["prepared_spans"] == 0
    assert len(result["verdict"].candidates) == 3


@pytest.mark.slow
def test_agent_notebook_runs_on_the_embedded_default(notebook_kernel):
    outputs = notebook_kernel.run("examples/judge/langchain_agent.ipynb",
                                  SPANQ_EXAMPLE_MAX_TOKENS="64", SPANQ_EXAMPLE_AGENTS="2")
    assert "agent 0: searched" in outputs and "3 spans, 3 computed now" in outputs
    assert "agent 1: searched" in outputs and "3 spans, 0 computed now" in outputs
    assert "verdict:" in outputs
