"""Spans reused after any prefix (the default anchor policy, "template"): a question before the documents, a
conversation that opened differently, and the exact "prefix" policy kept as an option. Each checks that the
second call prepares nothing and that its log-probabilities equal the HF span reference — and, for the
question-first prompt, that the same check fails when keys are not moved."""

from __future__ import annotations

import asyncio

import pytest
import torch

from benchmarks.hf_span import span_reference_logprobs
from spanq_backend.kv.relocation import KVRelocator
from spanq_integrations import (
    QueryParseError,
    QueryValidationError,
    assistant,
    cross,
    fragment,
    generate,
    plus,
    system,
    user,
)
from spanq_integrations.query.spnl_json import from_json, to_json
from tests.backend.logprobs import run_with_logprobs

pytestmark = [pytest.mark.vllm]

TOL = 2e-4


def docs(tag: str) -> dict[str, str]:
    return {
        c: f"Report {c}{tag}. " + " ".join(f"In {c}{tag}, bay {i} stores {i * 7 % 12} crates." for i in range(12))
        for c in "ABCD"
    }


def question_first(d: dict[str, str], question: str, order: str, anchor=None):
    """The shape of LangChain hub's rag prompt: one human turn, the question before the context."""
    return generate(
        cross(
            user(f"You are an assistant for question-answering tasks. Question: {question}\nContext:"),
            plus(*[fragment(d[c]) for c in order], anchor=anchor),
        ),
        max_tokens=5,
        temperature=0.0,
    )



def run(engine, first, second):
    """Run `first` (it prepares the documents), then `second` with logprobs, as the generator does."""
    async def scenario():
        cold = await engine.generate(first)
        warm = await engine.generate(second)
        lowered = engine.lower(second)
        return (cold.metrics, warm.metrics, lowered, *await run_with_logprobs(engine, lowered, 5))

    return asyncio.run(scenario())


@pytest.mark.parametrize("broken", [False, True], ids=["relocated", "relocation-off"])
def test_a_second_question_before_the_same_documents_prepares_nothing(engine, hf_model, monkeypatch, broken):
    tag = "q" + str(broken)
    d = docs(tag)
    if broken:
        monkeypatch.setattr(KVRelocator, "apply", lambda self, moves: None)
    cold, warm, lowered, cached, toks, lps = run(
        engine,
        question_first(d, f"Which bay stores 3 crates ({tag})?", "ABCD"),
        question_first(d, f"Where are 5 crates ({tag})?", "CADB"),
    )
    spans = lowered.table.spans
    assert cold.prepared_spans == 4
    # Nothing of the documents was cached before (at most the template's opening, which earlier calls share).
    assert cold.cached_tokens <= lowered.table.anchor_len
    assert warm.prepared_spans == 0, "the documents were prepared by the first question"
    assert cached >= spans[-1][1], "the new question's prefix and every document came from the cache"
    assert warm.cached_tokens >= sum(e - s for s, e in spans)
    ref = span_reference_logprobs(hf_model, lowered.token_ids, lowered.table, toks).double()
    close = lps.shape == ref.shape and torch.allclose(lps, ref, atol=TOL)
    assert close != broken, f"max |diff| = {(lps - ref).abs().max():.2e}"


def test_a_conversation_that_opened_differently_reuses_the_documents(engine, hf_model):
    d = docs("c")
    first = generate(
        cross(system("You are terse."), user("hi"), assistant("Hello."), plus(*[fragment(d[c]) for c in "ABC"]),
              user("Which bay stores 9 crates?")),
        max_tokens=5, temperature=0.0,
    )
    second = generate(
        cross(system("You are a librarian."), user("Good morning! How are you today?"), assistant("Well, thanks."),
              user("Here are the reports."), plus(*[fragment(d[c]) for c in "CBA"]), user("Where are 2 crates?")),
        max_tokens=5, temperature=0.0,
    )
    cold, warm, lowered, cached, toks, lps = run(engine, first, second)
    assert cold.prepared_spans == 3 and warm.prepared_spans == 0
    assert cached >= lowered.table.spans[-1][1]
    ref = span_reference_logprobs(hf_model, lowered.token_ids, lowered.table, toks).double()
    assert torch.allclose(lps, ref, atol=TOL), f"max |diff| = {(lps - ref).abs().max():.2e}"


def test_the_prefix_policy_keeps_the_exact_prefix_anchor(engine, hf_model):
    d = docs("p")
    q1 = question_first(d, "Which bay stores 3 crates?", "ABCD", anchor="prefix")
    q2 = question_first(d, "Which bay stores 3 crates?", "DBAC", anchor="prefix")
    other = question_first(d, "Another question?", "ABCD", anchor="prefix")
    _cold, warm, lowered, cached, toks, lps = run(engine, q1, q2)
    assert lowered.table.anchors is None, "anchored on the prompt's own prefix"
    assert warm.prepared_spans == 0 and cached >= lowered.table.spans[-1][1]
    ref = span_reference_logprobs(hf_model, lowered.token_ids, lowered.table, toks).double()
    assert torch.allclose(lps, ref, atol=TOL), f"max |diff| = {(lps - ref).abs().max():.2e}"
    after_other = asyncio.run(engine.generate(other)).metrics
    assert after_other.prepared_spans == 4, "under the prefix policy another question means other spans"


def test_an_unknown_anchor_policy_is_refused_by_name():
    with pytest.raises(QueryValidationError, match="unknown anchor policy 'left'"):
        plus(fragment("a"), fragment("b"), anchor="left")
    doc = to_json(plus(fragment("a"), fragment("b"), anchor="prefix"))
    assert doc["anchor"] == "prefix" and from_json(doc) == plus(fragment("a"), fragment("b"), anchor="prefix")
    with pytest.raises(QueryParseError, match=r"\$\.anchor: unknown anchor policy \"left\""):
        from_json({"plus": [{"fragment": "a"}], "anchor": "left"})
