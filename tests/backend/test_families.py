"""Span reuse on the model families people deploy, each a tiny random model built locally (`families.py`).

For every family the support table calls exact: four documents read in order ABCD, then DCBA, on the real
embedded engine → the second run prepares no span, and its log-probabilities equal the HF transformers span
reference to fp32 tolerance; then eight orders at once (CIDRA's copies) → each equals the reference too. For
the families it refuses: a clear error naming why, before any engine starts. And the checks that make the rows
true are shown to matter: with one RoPE for Gemma 3's two, or with vLLM's split KV cache for Gemma 2's
sliding-window layers, answers would be wrong, and spanq refuses or moves them right.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from benchmarks.hf_span import full_attention_logprobs, load_hf_model, span_reference_logprobs
from spanq_backend.serving.families import FAMILIES
from spanq_integrations import cross, fragment, generate, plus, system, user
from tests.backend.logprobs import run_with_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXACT = [name for name, f in FAMILIES.items() if not f.spans.startswith("refused")]
REFUSED = [name for name, f in FAMILIES.items() if f.spans.startswith("refused")]
TOL = 2e-4

DOCS = {
    c: f"Ledger {c}. " + " ".join(f"Entry {i} of {c} reads {i * 3 % 7}." for i in range(14)) for c in "ABCD"
}
PREAMBLE = "Background: " + " ".join(f"note {i} is filed under shelf {i % 9}." for i in range(30))


def query(order: str):
    """A preamble before the documents: spans are read hundreds of positions from where they were prepared."""
    return generate(
        cross(system("Answer from the ledgers."), user(PREAMBLE), plus(*[fragment(DOCS[c]) for c in order]),
              user("Which entry reads 5?")),
        max_tokens=5,
        temperature=0.0,
    )


def start(name: str, **options):
    from spanq_backend.serving.engine import SpanEngine

    return SpanEngine(**{"model": f"tiny-{name}", "block_size": 32, "max_model_len": 2048, "max_num_seqs": 8,
                         "cold_spans": "isolate", "recompute": 0, **options})  # prepared alone first: read as spans next


@pytest.fixture(scope="module", params=EXACT)
def family(request):
    """(name, engine, HF model) of one family: one engine per family, shared by its tests."""
    engine = start(request.param)
    hf = load_hf_model(engine.model_path)
    yield request.param, engine, hf
    engine.close()


def reordered(engine):
    async def scenario():
        first = engine.lower(query("ABCD"))
        prepared_first = await engine.prepare(first)
        await run_with_logprobs(engine, first, 5)
        second = engine.lower(query("DCBA"))
        prepared_second = await engine.prepare(second)
        return prepared_first, prepared_second, second, *await run_with_logprobs(engine, second, 5)

    return asyncio.run(scenario())


def test_reordered_spans_are_reused_and_match_the_reference(family):
    name, engine, hf = family
    assert engine.span_support.enabled, engine.span_support.reason
    prepared_first, prepared_second, lowered, cached, toks, lps = reordered(engine)
    assert prepared_first == 4
    assert prepared_second == 0, "DCBA found every span ABCD prepared"
    assert cached >= lowered.table.spans[-1][1]
    ref = span_reference_logprobs(hf, lowered.token_ids, lowered.table, toks).double()
    assert (lps - ref).abs().max() < TOL, f"{name}: max |diff| = {(lps - ref).abs().max():.2e}"
    # span attention is not full attention on this model: the reference tells them apart
    full = full_attention_logprobs(hf, lowered.token_ids, toks).double()
    assert (full - lps).abs().max() > 10 * TOL


def test_eight_orders_at_once_match_the_reference(family):
    """Eight orders in one batch: blocks read at several positions at once get private copies (CIDRA)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    name, engine, hf = family
    orders = ["".join(p) for p in itertools.permutations("ABCD")][::3][:8]

    async def run(order):
        lowered = engine.lower(query(order))
        params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, output_kind=RequestOutputKind.DELTA)
        outs, _ = await engine.run_tokens(lowered.token_ids, params, lowered.table)
        toks = [t for o in outs for t in o.outputs[0].token_ids]
        lps = [lp[t].logprob for o in outs for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [])]
        return lowered, toks, torch.tensor(lps, dtype=torch.float64)

    async def scenario():
        await engine.prepare(engine.lower(query("ABCD")))
        return await asyncio.gather(*(run(o) for o in orders))

    for order, (lowered, toks, lps) in zip(orders, asyncio.run(scenario())):
        ref = span_reference_logprobs(hf, lowered.token_ids, lowered.table, toks).double()
        assert (lps - ref).abs().max() < TOL, f"{name} {order}: max |diff| = {(lps - ref).abs().max():.2e}"


def miss_on_a_fresh_engine(name: str) -> float:
    """ABCD then DCBA on a new engine of `name` with spans on: how far its logprobs are from the reference."""
    engine = start(name)
    try:
        assert engine.span_support.enabled, engine.span_support.reason
        hf = load_hf_model(engine.model_path)
        _, _, lowered, _, toks, lps = reordered(engine)
    finally:
        engine.close()
    ref = span_reference_logprobs(hf, lowered.token_ids, lowered.table, toks).double()
    return float((lps - ref).abs().max())


@pytest.mark.parametrize("name", REFUSED)
def test_a_refused_family_is_refused_by_name_before_the_engine_starts(name):
    from spanq_backend.serving.engine import SpanEngine
    from spanq_integrations.query.errors import BackendError

    with pytest.raises(BackendError, match="spans are refused") as raised:
        SpanEngine(model=f"tiny-{name}", max_model_len=2048)
    assert FAMILIES[name].spans.removeprefix("refused: ")[:40] in str(raised.value)


def test_one_rope_for_gemma3s_two_would_be_wrong(monkeypatch):
    """Gemma 3's global layers turn with another base than its local ones: moving every layer's keys with the
    first layer's RoPE (what spanq did before it read each layer's own) misses the reference."""
    from spanq_backend.vllm_integration import kv_layout

    real = kv_layout.rope_specs_of_layers
    monkeypatch.setattr(kv_layout, "rope_specs_of_layers", lambda model, names: [real(model, names)[0]] * len(names))
    assert miss_on_a_fresh_engine("gemma3") > 10 * TOL


def test_gemma2_with_vllms_split_kv_cache_is_refused_not_wrong(monkeypatch):
    """Left to itself, vLLM keeps Gemma 2's sliding-window layers in a KV cache group of their own, whose blocks
    spanq's tracker never sees. spanq starts such models with one group; an engine started with two is refused
    (and, without that refusal, answers miss the reference)."""
    from spanq_backend.vllm_integration import kv_layout, worker

    monkeypatch.setattr(kv_layout, "has_sliding_window_layers", lambda path: False)
    engine = start("gemma2")
    try:
        assert not engine.span_support.enabled
        assert "split into 2 groups" in engine.span_support.reason
    finally:
        engine.close()
    # Without the group check and the check that no cache tensor is listed twice (the two groups' layers share
    # tensors), the start-up self-check still refuses: it moves keys on every layer, and a shared tensor's keys
    # are moved twice (it checked layer 0 only until 2026-12-02, and let this through).
    monkeypatch.setattr(worker, "single_kv_cache_group", lambda runner: None)
    monkeypatch.setattr(kv_layout, "layer_names_of", lambda runner, caches: [""] * len(caches))
    engine = start("gemma2")
    try:
        assert not engine.span_support.enabled
        assert "self-check" in engine.span_support.reason, engine.span_support.reason
    finally:
        engine.close()
    # Without all three, spans would be served, and wrong.
    monkeypatch.setattr(kv_layout, "self_check", lambda *args, **kwargs: None)
    assert miss_on_a_fresh_engine("gemma2") > 10 * TOL


def test_a_sliding_window_shorter_than_the_context_turns_spans_off_saying_why():
    """Gemma 2's 4096-token window covers a 2048-token engine; an 8192-token engine would read spans past it."""
    engine = start("gemma2", max_model_len=8192)
    try:
        assert not engine.span_support.enabled
        assert "4096-token window" in engine.span_support.reason
        assert "max_model_len <= 4096" in engine.span_support.reason
    finally:
        engine.close()
