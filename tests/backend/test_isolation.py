"""Isolation (invariant 1 of docs/design.md): KV computed in context is never stored under a span's key.

Provoked twice: prepared span blocks are evicted before the request that reads them runs (a small KV cache
and filler requests), and two requests race on the same new spans. In both cases the request still answers
(its spans computed in context), and afterwards the spans' keys still lead to isolated KV only: a later
query over the same fragments matches the independent HF span-attention reference.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from benchmarks.hf_span import span_reference_logprobs
from spanq_integrations import BackendError, cross, fragment, generate, plus, system, user

pytestmark = [pytest.mark.vllm]

TOL = 2e-4


def docs(tag: str) -> dict[str, str]:
    return {c: f"Note {c}{tag}. " + " ".join(f"{c.lower()}{tag} item {i} is {i * 7 % 11}." for i in range(15)) for c in "ABCD"}


def query(d: dict[str, str], order: str):
    return generate(
        cross(system("Answer from the notes."), plus(*[fragment(d[c]) for c in order]), user("Which item is 3?")),
        max_tokens=5,
        temperature=0.0,
    )


@pytest.fixture(scope="module")
def small_engine(tiny_model):
    """An engine with 48 KV blocks of 32 tokens: a few requests are enough to evict prepared spans. Its anchors
    hold no lead-in (the default one takes 9 of the 48 blocks: the budget below is counted without it)."""
    from spanq_backend.serving.engine import SpanEngine

    eng = SpanEngine(model=str(tiny_model), block_size=32, max_model_len=1024, max_num_seqs=4, num_blocks=48,
                     span_lead_in="none", recompute=0)
    yield eng
    eng.close()


async def run_plain(engine, lowered, with_table: bool = True):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, output_kind=RequestOutputKind.DELTA)
    outs, _ = await engine.run_tokens(lowered.token_ids, params, lowered.table if with_table else None)
    toks, lps = [], []
    for o in outs:
        for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or []):
            toks.append(t)
            lps.append(lp[t].logprob)
    return outs[-1].num_cached_tokens or 0, toks, torch.tensor(lps, dtype=torch.float64)


async def prepare_costs(engine, lowered) -> list[int]:
    """Tokens each span's prepare request had to compute (0: found in the cache)."""
    from vllm import SamplingParams

    costs = []
    for i in range(len(lowered.table.spans)):
        ids = lowered.prepare_prompt(i) + [engine.pad_token_id]
        outs, _ = await engine.run_tokens(ids, SamplingParams(max_tokens=1, temperature=0.0))
        costs.append(len(ids) - 1 - (outs[-1].num_cached_tokens or 0))
    return costs


def assert_matches_reference(hf_model, lowered, toks, lps):
    ref = span_reference_logprobs(hf_model, lowered.token_ids, lowered.table, toks).double()
    assert torch.allclose(lps, ref, atol=TOL), f"max |diff| = {(lps - ref).abs().max():.2e}"


def test_spans_evicted_before_use_are_computed_in_context_and_not_cached_as_spans(small_engine, hf_model):
    engine = small_engine
    d = docs("e")

    async def scenario():
        lowered = engine.lower(query(d, "ABCD"))
        await engine.prepare(lowered)
        # Filler requests take over the small cache: the prepared span blocks are evicted.
        for k in range(3):
            filler = engine.lower(generate(user(f"filler {k} " + "word " * 700), max_tokens=1))
            await run_plain(engine, filler, with_table=False)
        cached, _, _ = await run_plain(engine, lowered)  # reads spans that are gone: computed in context
        after = await prepare_costs(engine, lowered)
        second = engine.lower(query(d, "DCBA"))
        await engine.prepare(second)
        return lowered, cached, after, second, await run_plain(engine, second)

    lowered, cached, after, second, (cached2, toks, lps) = asyncio.run(scenario())
    span_end = lowered.table.spans[-1][1]
    assert cached < span_end, "the spans were evicted, so the request could not find them"
    assert all(c > 0 for c in after), f"a span's key led to KV computed in context: prepare costs {after}"
    assert cached2 >= span_end
    assert_matches_reference(hf_model, second, toks, lps)


def test_requests_racing_on_new_spans_leave_only_isolated_kv(small_engine, hf_model):
    engine = small_engine
    d = docs("r")

    async def scenario():
        first = engine.lower(query(d, "ABCD"))
        # The request reads the spans while their prepare requests run beside it, in the same steps.
        racing = await asyncio.gather(run_plain(engine, first), engine.prepare(first))
        second = engine.lower(query(d, "BADC"))
        await engine.prepare(second)
        return racing, second, await run_plain(engine, second)

    (racing, _), second, (cached2, toks, lps) = asyncio.run(scenario())
    # The racing request itself: whatever it found cached was isolated span KV, and everything after that was
    # computed in context (attending to all before it), never read as a span that was not there yet.
    first = engine.lower(query(d, "ABCD"))
    cached, r_toks, r_lps = racing
    spans = first.table.spans
    hit = [span for span in spans if span[1] <= cached]
    assert cached <= first.table.anchor_len or cached in {e for _, e in spans}, (
        f"the hit ends inside a span ({cached}): {spans}"
    )
    ref = span_reference_logprobs(hf_model, first.token_ids, hit, r_toks).double()  # no spans: full attention
    assert torch.allclose(r_lps, ref, atol=TOL), f"racing run: max |diff| = {(r_lps - ref).abs().max():.2e}"
    assert cached2 >= second.table.spans[-1][1]
    assert_matches_reference(hf_model, second, toks, lps)


def test_concurrent_queries_over_the_same_new_spans_match_the_reference(small_engine, hf_model):
    engine = small_engine
    d = docs("c")

    async def one(order):
        lowered = engine.lower(query(d, order))
        await engine.prepare(lowered)
        return lowered, await run_plain(engine, lowered)

    async def scenario():
        return await asyncio.gather(one("ABCD"), one("DBCA"))

    for lowered, (_, toks, lps) in asyncio.run(scenario()):
        assert_matches_reference(hf_model, lowered, toks, lps)


def test_a_model_whose_keys_cannot_move_is_refused_before_vllm_starts(tiny_model, tmp_path):
    from spanq_backend.serving.engine import SpanEngine

    dynamic = tmp_path / "tiny-dynamic-ntk"
    shutil.copytree(tiny_model, dynamic)
    cfg = json.loads((dynamic / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 100000.0}
    (dynamic / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BackendError, match="dynamic NTK"):
        SpanEngine(model=str(dynamic))


def test_spans_found_in_the_cache_send_no_prepare_request_until_evicted(small_engine):
    """The in-process engine looks its spans up in vLLM's block pool: a cached span costs no engine request;
    once evicted, the lookup says so and the prepare runs again."""
    engine = small_engine
    d = docs("p")
    sent: list[list[int]] = []
    stream = engine.generator.stream

    def counting(prompt_ids, params):
        sent.append(list(prompt_ids))
        return stream(prompt_ids, params)

    async def scenario():
        engine.generator.stream = counting
        try:
            first = engine.lower(query(d, "ABCD"))
            computed_first = await engine.prepare(first)
            # the prompt prefix is computed too where no earlier test of the module left it cached
            sent_first = len([p for p in sent if p != first.prefix_prompt() + [engine.pad_token_id]])
            sent.clear()
            second = engine.lower(query(d, "DCBA"))
            computed_second = await engine.prepare(second)
            sent_second = len(sent)
            for k in range(3):  # evict
                await run_plain(engine, engine.lower(generate(user(f"filler {k} " + "word " * 700), max_tokens=1)),
                                with_table=False)
            before = len(sent)
            computed_third = await engine.prepare(second)
            prefix = second.prefix_prompt() + [engine.pad_token_id]
            spans_sent = [p for p in sent[before:] if p != prefix]  # the prompt prefix may need computing too
            return computed_first, sent_first, computed_second, sent_second, computed_third, len(spans_sent)
        finally:
            engine.generator.stream = stream

    c1, s1, c2, s2, c3, s3 = asyncio.run(scenario())
    assert (c1, s1) == (4, 4), "four new spans: four prepare requests"
    assert (c2, s2) == (0, 0), "every span cached: no request at all"
    assert c3 > 0 and s3 == c3, "evicted spans are prepared again, and only those"


def test_a_stale_cache_answer_costs_time_not_correctness(small_engine, hf_model):
    """If the lookup says "cached" and the blocks are gone by the time the request runs, the spans are computed
    in context and not cached as spans: a later honest query still reads isolated KV only."""
    engine = small_engine
    d = docs("s")

    async def scenario():
        honest = engine.generator.span_cached
        engine.generator.span_cached = lambda ids: True  # as stale as it gets: nothing was ever prepared
        try:
            answered = await engine.generate(query(d, "ABCD"))
        finally:
            engine.generator.span_cached = honest
        lowered = engine.lower(query(d, "CADB"))
        costs = await prepare_costs(engine, lowered)
        await engine.prepare(lowered)  # the prompt's own prefix (the spans are cached by now), as a query would
        return answered, costs, lowered, await run_plain(engine, lowered)

    answered, costs, lowered, (cached, toks, lps) = asyncio.run(scenario())
    assert answered.metrics.prepared_spans == 0 and answered.texts[0] is not None
    assert all(c > 0 for c in costs), f"KV computed in context was found under a span's key: {costs}"
    assert cached >= lowered.table.spans[-1][1]
    assert_matches_reference(hf_model, lowered, toks, lps)
