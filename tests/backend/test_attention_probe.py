"""`recompute="attention"` (docs/design.md, "Recompute"): the blocks recomputed are those the question attends to
most at the model's middle layer, read by the engine itself in a pass of the prompt before the recompute round
(`spanq_backend/vllm_integration/attention_probe.py`).

What the engine reads is checked against the HF reference's attention weights under span attention
(`benchmarks.hf_span.span_attention_weights`, itself checked in test_hf_attention_weights.py), block by block; a
probe that lets a row attend to the question's later tokens (no causal mask) must fail the same check. The call
then recomputes exactly the blocks the reference ranks first, and answers as the HF reference of that plan does.
"""

from __future__ import annotations

import asyncio
import weakref
from unittest.mock import patch

import pytest
import torch

from benchmarks.hf_span import span_attention_weights, span_reference_logprobs
from spanq_backend.serving.recompute import plan_recompute, question_start
from spanq_backend.vllm_integration import attention_probe
from spanq_integrations import cross, fragment, generate, plus, system, user
from tests.backend.logprobs import run_with_logprobs

TOL = 2e-4


@pytest.fixture(scope="module")
def engine(tiny_model):
    from spanq_backend.serving.engine import SpanEngine

    eng = SpanEngine(model=str(tiny_model), block_size=32, max_model_len=2048, max_num_seqs=8, cold_spans="isolate",
                     recompute="attention")
    yield eng
    eng.close()


DOCS = {
    c: f"Logbook {c}. " + " ".join(f"Crate {c}-{i} went to pier {i * 7 % 11} with {i * 3 % 5} sacks of salt." for i in range(12))
    for c in "ABC"
}


def query(order: str, question: str, recompute=None):
    return generate(cross(system("Answer from the logbooks."), plus(*[fragment(DOCS[c]) for c in order]), user(question)),
                    max_tokens=4, temperature=0.0, recompute=recompute)


def reference_mass(hf_model, lowered, pad) -> torch.Tensor:
    """Per prompt block, the attention the question's rows give its keys at the middle layer (HF, span attention)."""
    table = lowered.table
    weights = span_attention_weights(hf_model, lowered.token_ids, table)
    layer = weights[len(weights) // 2]
    rows = question_start(lowered, pad) - table.spans[-1][1]
    per_token = layer[:, rows:, :].sum(dim=(0, 1)).double()
    bs = table.block_size
    padded = torch.zeros((per_token.numel() + bs - 1) // bs * bs, dtype=torch.float64)
    padded[: per_token.numel()] = per_token
    return padded.view(-1, bs).sum(dim=1)


def warm(engine, call):
    """The spans prepared alone (nothing recomputed), as the probe reads them; the call lowered."""
    asyncio.run(engine.generate(call.model_copy(update={"recompute": 0})))
    return engine.lower(call)


def warm_with_reference(engine, hf_model, order: str, question: str):
    """The call, warm (`warm`), its lowering, the pad token and the reference's attention mass per block."""
    call = query(order, question)
    lowered = warm(engine, call)
    pad = engine.generator.pad_token_id
    return call, lowered, pad, reference_mass(hf_model, lowered, pad)


def probe(engine, lowered):
    gen = engine.generator
    gen._probed.clear()
    return asyncio.run(gen.probe_attention(lowered))


@pytest.mark.vllm
def test_the_engine_reads_the_question_s_attention_per_block_as_the_reference_and_without_the_mask_it_does_not(engine, hf_model):
    _call, lowered, pad, want = warm_with_reference(engine, hf_model, "ABC", "Which crate went to pier 3 with salt?")
    mass, info = probe(engine, lowered)
    assert mass is not None and "fallback" not in info, info
    got = torch.tensor(mass, dtype=torch.float64)
    assert got.shape == want.shape
    rows = len(lowered.token_ids) - question_start(lowered, pad)
    assert info["rows"] == rows and info["layer"].endswith(f".{len(hf_model.model.layers) // 2}.self_attn.attn")
    heads = hf_model.config.num_attention_heads
    assert abs(float(got.sum()) - rows * heads) < 1e-3, "every row's probabilities, summed over heads"
    assert float((got - want).abs().max()) < TOL * rows * heads, (got, want)
    assert got[[s // 32 for s, _ in lowered.table.spans]].sum() > 0, "the spans' blocks are read"

    # the check can fail: a probe whose rows also attend to the question's later tokens
    def unmasked(q, keys, scale, start):
        k = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        return torch.softmax(torch.einsum("rhd,lhd->hrl", q, k) * scale, dim=-1).sum(dim=(0, 1)).double()

    with patch.object(attention_probe, "attention_mass", unmasked):
        broken, _ = probe(engine, lowered)
    assert float((torch.tensor(broken, dtype=torch.float64) - want).abs().max()) > 10 * TOL * rows * heads


@pytest.mark.vllm
def test_a_probe_batched_beside_another_request_reads_its_own_rows(engine, hf_model):
    """A step that computes another request too (here one decoding a long answer, scheduled first) puts the probe's
    rows after the other's in the layer's query: the probe reads its own, and the same mass as the reference."""
    _call, lowered, pad, want = warm_with_reference(engine, hf_model, "ACB", "Which crate went to pier 6?")
    rows = len(lowered.token_ids) - question_start(lowered, pad)
    heads = hf_model.config.num_attention_heads
    seen: list[tuple[int, int]] = []  # (requests in the step, the probe's first row in the layer's query)
    read = attention_probe.Probes.read

    def recording(self, impl, query, kv_cache, meta, shift=0):
        req_ids = list(self.runner().input_batch.req_ids)
        for i, r in enumerate(req_ids):
            if r in self.active:
                seen.append((len(req_ids), int(meta.query_start_loc[i])))
        return read(self, impl, query.roll(shift, 0) if shift else query, kv_cache, meta)

    other = generate(user("Count from one to one hundred, one number a line."), max_tokens=96, temperature=0.0)

    async def beside(reader):
        gen = engine.generator
        gen._probed.clear()
        seen.clear()
        with patch.object(attention_probe.Probes, "read", reader):
            answer = asyncio.ensure_future(engine.generate(other))
            await asyncio.sleep(0.2)  # the other request is decoding by now
            mass, info = await gen.probe_attention(lowered)
            await answer
        return mass, info

    mass, info = asyncio.run(beside(recording))
    assert any(n > 1 and first > 0 for n, first in seen), f"the probe shared no step with the other request: {seen}"
    assert mass is not None and info["rows"] == rows, info
    got = torch.tensor(mass, dtype=torch.float64)
    assert float((got - want).abs().max()) < TOL * rows * heads, (got, want)

    # the check can fail: a read whose query rows are not the probe's (shifted by the other request's row) is
    # outside the bound the probe's own rows meet (the tiny model's attention is near uniform: the margin is small)
    mass, _ = asyncio.run(beside(lambda *a: recording(*a, shift=1)))
    assert mass is None or float((torch.tensor(mass, dtype=torch.float64) - want).abs().max()) > TOL * rows * heads


def test_workers_results_are_summed_only_when_every_worker_kept_one_and_a_step_not_causal_is_refused():
    from types import SimpleNamespace

    a = {"blocks": [1.0, 2.0], "rows": 3, "layer": "l"}
    b = {"blocks": [0.5, 0.5], "rows": 3, "layer": "l"}
    assert attention_probe.combine_workers([a, b]) == {"blocks": [1.5, 2.5], "rows": 3, "layer": "l"}
    assert attention_probe.combine_workers([None, None]) is None
    assert "1 of the engine's 2 workers" in attention_probe.combine_workers([a, None])["error"], \
        "a sum over one rank's heads is not the layer's mass"
    assert attention_probe.combine_workers([a, {"error": "why"}]) == {"error": "why"}
    assert "different rows" in attention_probe.combine_workers([a, {**b, "rows": 2}])["error"]
    starts = torch.tensor([0, 4, 9])
    plain = SimpleNamespace(causal=True, dynamic_causal=None, query_start_loc=starts, seq_lens=torch.tensor([4, 9]))
    assert attention_probe._unsupported_metadata(plain, 2) == ""
    assert "not causal" in attention_probe._unsupported_metadata(SimpleNamespace(**{**vars(plain), "causal": False}), 2)
    assert "not causal" in attention_probe._unsupported_metadata(
        SimpleNamespace(**{**vars(plain), "dynamic_causal": torch.ones(9, dtype=torch.bool)}), 2)
    virtual = SimpleNamespace(**{**vars(plain), "query_start_loc": torch.tensor([0, 2, 4, 9]), "seq_lens": torch.tensor([2, 4, 9])})
    assert "one row range per request" in attention_probe._unsupported_metadata(virtual, 2)


@pytest.mark.vllm
def test_the_probe_reads_every_row_of_the_question_even_where_the_same_prompt_was_answered_before(engine):
    """The same prompt answered with nothing recomputed caches the question's whole blocks under the span layout; a
    probe would then compute (and read) only the rows after them. Its blocks from the question on are its own
    (hashed with the probe's id), so it reads every row; hashed as the prompt's, it would not, and says so."""
    from spanq_backend.vllm_integration.engine_core import SpanBlockHasher

    long_question = "Which crate went to pier 5, and which pier did crate C-7 go to, with how many sacks of salt? " * 2
    call = query("CBA", long_question)
    lowered = warm(engine, call)  # answered at 0: the question's whole blocks are cached now
    asked = len(lowered.token_ids) - question_start(lowered, engine.generator.pad_token_id)
    assert asked > 2 * lowered.table.block_size, "the question spans whole blocks"
    mass, info = probe(engine, lowered)
    assert mass is not None and info["rows"] == asked, info
    with patch.object(SpanBlockHasher, "_probe_salted", lambda self, request, table, new: new):
        broken, info = probe(engine, lowered)
    assert broken is None and "rows" in info["fallback"], info


@pytest.mark.vllm
def test_a_call_recomputes_the_blocks_the_question_attends_to_most_and_answers_as_the_reference(engine, hf_model):
    call, lowered, _pad, want = warm_with_reference(engine, hf_model, "BCA", "Where did crate B-4 go?")
    table, bs = lowered.table, lowered.table.block_size
    ranked = sorted((-float(want[s // bs + b]), (i, b)) for i, (s, e) in enumerate(table.spans) for b in range((e - s) // bs))
    expected = tuple(sorted(pair for _, pair in ranked[: len(table.spans)]))
    engine.generator._probed.clear()

    async def scenario():
        done = await engine.generate(call)
        plan, info = await engine.generator.plan(call, lowered)  # the same prompt: the probe's answer reused
        return done, plan, info, await run_with_logprobs(engine, plan.lowered, 4)

    done, plan, info, (_cached, toks, lps) = asyncio.run(scenario())
    m = done.metrics
    assert m.fallback is None and m.extra["attention_probe"]["rows"] > 0 and m.extra["phases_s"]["probe"] > 0, m.extra
    assert info == {"reused": True} and plan.blocks == expected, (plan.blocks, expected)
    assert m.extra["recomputed_tokens"] == len(table.spans) * bs
    ref = span_reference_logprobs(hf_model, lowered.token_ids, plan_recompute(lowered, expected).lowered.table, toks).double()
    assert (lps - ref).abs().max().item() < TOL
    # and not the choice by the question's words on this prompt (else the test would not tell them apart)
    words = engine.generator.recompute_plan(call.model_copy(update={"recompute": "question"}), lowered)
    assert words.blocks != expected


@pytest.mark.vllm
def test_a_backend_that_cannot_read_attention_chooses_by_the_question_s_words_and_says_so(engine):
    call = query("CAB", "Which crate had 4 sacks?")
    warm(engine, call)
    gen = engine.generator
    kept = gen.attention_scores
    gen.attention_scores = None
    try:
        done = asyncio.run(engine.generate(call))
    finally:
        gen.attention_scores = kept
    words = asyncio.run(engine.generate(call.model_copy(update={"recompute": "question"})))
    assert "cannot read attention" in (done.metrics.fallback or "")
    assert done.metrics.extra["recomputed_tokens"] == words.metrics.extra["recomputed_tokens"] > 0
    assert done.texts == words.texts


@pytest.mark.vllm
def test_a_closed_engine_leaves_its_model_runner_to_be_freed(tiny_model):
    """The span state of a model runner (`worker.runner_spans`, weak keys) must not hold the runner: an engine
    closed would otherwise keep its KV cache for the life of the process (a test session ran out of memory so).
    The probes hold it weakly; held strongly, the runner outlives its engine."""
    import gc

    from spanq_backend.serving.engine import SpanEngine
    from spanq_backend.vllm_integration import worker

    def live_after_one_engine() -> int:
        gc.collect()
        before = len(list(worker.runner_spans.values()))
        eng = SpanEngine(model=str(tiny_model), block_size=32, max_model_len=1024, max_num_seqs=2, num_blocks=64)
        assert len(list(worker.runner_spans.values())) == before + 1
        eng.close()
        del eng
        gc.collect()
        return len(list(worker.runner_spans.values())) - before

    gc.collect()
    start = len(list(worker.runner_spans.values()))
    assert live_after_one_engine() == 0
    with patch.object(attention_probe, "_hold", lambda obj: (lambda: obj)):
        assert live_after_one_engine() == 1, "the check can fail: a strong reference keeps the runner"
    # and the runner it kept is let go again, not carried through the rest of the session
    for state in worker.runner_spans.values():
        if state.runtime is not None and not isinstance(state.runtime.probes.runner, weakref.ReferenceType):
            state.runtime.probes.runner = lambda: None
    gc.collect()
    assert len(list(worker.runner_spans.values())) == start

