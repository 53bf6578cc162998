"""One default temperature story (README, "Temperature"): a call that says nothing samples at spnl's 0.6 through
every front door — the builder, spnl JSON, LangChain's models, LlamaIndex's LLM — and judges are greedy; and
the adapters name each span setting the same way.

A front door with its own default fails here (LlamaIndex's `SpanQueryLLM` defaulted to 0 until 2026-12-02,
while `generate` and LangChain sampled at 0.6: `test_every_front_door_samples_at_spnls_default` failed on it).
"""

from __future__ import annotations

import pytest

from spanq_integrations import from_json, generate, user
from spanq_integrations.query.ir import DEFAULT_TEMPERATURE
from spanq_integrations.runtime.judge import judge_query


def test_every_front_door_samples_at_spnls_default():
    assert DEFAULT_TEMPERATURE == 0.6
    assert generate(user("Hi")).temperature == DEFAULT_TEMPERATURE
    assert from_json({"g": {"model": "", "input": {"user": "Hi"}}}).temperature == DEFAULT_TEMPERATURE
    langchain = pytest.importorskip("spanq_integrations.langchain")
    for model in (langchain.ChatSpanQuery(backend="http://127.0.0.1:9"), langchain.SpanQueryLLM(backend="http://127.0.0.1:9")):
        assert model._settings(None, {}).temperature == DEFAULT_TEMPERATURE, type(model).__name__
        assert model._settings(None, {"temperature": 0}).temperature == 0.0
    llamaindex = pytest.importorskip("spanq_integrations.llamaindex")
    assert llamaindex.SpanQueryLLM(backend="http://127.0.0.1:9").temperature == DEFAULT_TEMPERATURE


def test_judges_are_greedy_whatever_the_answers_sample_at():
    verdict = judge_query(["Paris.", "Lyon."], "Which answer names the capital of France?")
    assert verdict.temperature == 0.0


def test_the_adapters_name_their_span_settings_alike():
    """One name per setting across the adapters that send spans: a user moving from LangChain to LlamaIndex
    (or back) writes `span_anchor`, `recompute` and `recover_documents` the same way, and the judges' fan-in
    is `k` everywhere."""
    import inspect

    from spanq_integrations.runtime.judge import judge

    langchain = pytest.importorskip("spanq_integrations.langchain")
    llamaindex = pytest.importorskip("spanq_integrations.llamaindex")
    settings = {"span_anchor", "recompute", "recover_documents"}
    for model in (langchain.ChatSpanQuery, langchain.SpanQueryLLM, llamaindex.SpanQueryLLM):
        assert settings <= set(model.model_fields), (model.__module__, settings - set(model.model_fields))
    assert "k" in inspect.signature(judge).parameters
    assert "k" in langchain.JudgeEnsemble.model_fields
    for judge_class in (llamaindex.SpanQueryPairwiseEvaluator, llamaindex.SpanQueryTreeSynthesizer):
        assert "k" in inspect.signature(judge_class).parameters, judge_class.__name__
