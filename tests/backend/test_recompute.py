"""Selective recompute (docs/design.md, "Recompute"): chosen span blocks computed again in context, the rest of
each span read from the cache.

On the engine: a warm query with recompute prepares no span, finds every block cached when it runs (its recompute
requests computed the chosen blocks first), and its log-probabilities equal the HF reference built the same way
(a recomputed block attends to everything before it, the rest of its span to the span's anchor) — and differ,
beyond the tolerance, from the reference without recompute, so an engine that ignored the setting would fail.
Recomputed KV never lands under a span's key: afterwards a query without recompute over the same documents
still matches the plain span reference. `recompute=0` keeps today's results bit for bit.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from benchmarks.hf_span import span_reference_logprobs
from spanq_backend.kv.span_table import SpanTable
from spanq_backend.serving.lowering import LoweredPrompt
from spanq_backend.serving.recompute import choose_blocks, plan_recompute, recompute_setting
from spanq_integrations import cross, fragment, generate, plus, system, user
from spanq_integrations.query.spnl_json import from_json, to_json
from tests.backend.logprobs import run_with_logprobs
from tests.backend.settings import temporarily

TOL = 2e-4


@pytest.fixture(scope="module")
def engine(tiny_model):
    """The tiny model's engine, configured to recompute each span's first block when a call says nothing."""
    from spanq_backend.serving.engine import SpanEngine

    eng = SpanEngine(model=str(tiny_model), block_size=32, max_model_len=2048, max_num_seqs=8, cold_spans="isolate",
                     recompute="first")
    yield eng
    eng.close()


def docs(tag: str) -> dict[str, str]:
    return {
        c: f"Ledger {c}{tag}. " + " ".join(f"Shelf {c}{tag}-{i} holds {i * 5 % 13} jars of {tag} jam." for i in range(14))
        for c in "ABCD"
    }


def query(d: dict[str, str], order: str, question: str, recompute=None):
    return generate(
        cross(system("Answer from the ledgers."), plus(*[fragment(d[c]) for c in order]), user(question)),
        max_tokens=5,
        temperature=0.0,
        recompute=recompute,
    )


# ------------------------------------------------------------------------------------------- the layout (pure)


def _lowered(spans, anchors=None, n=None, bs=4):
    ids = list(range(100, 100 + (n or spans[-1][1] + 8)))
    return LoweredPrompt(token_ids=ids, table=SpanTable(bs, tuple(spans), anchors))


def test_a_recomputed_block_becomes_context_and_the_rest_of_its_span_keeps_its_anchor():
    low = _lowered([(8, 20), (20, 28)])  # blocks of 4: span 0 has 3 blocks, span 1 has 2
    plan = plan_recompute(low, [(0, 1)])
    t = plan.lowered.table
    assert t.spans == ((8, 12), (16, 20), (20, 28))
    # The piece after the recomputed block is anchored on the span's anchor and the span's tokens before it: what
    # those blocks were computed after in the span's prepare request.
    assert t.anchor_of(0) == 8
    assert t.anchor_of(1) == tuple(low.token_ids[:8] + low.token_ids[8:16])
    assert t.anchor_of(2) == 8
    assert plan.ends == (16,)  # span blocks follow the recomputed one: it needs a request of its own
    assert plan.tokens == 4


def test_the_first_block_of_the_first_span_moves_the_prefix_so_anchors_become_tokens():
    low = _lowered([(8, 16), (16, 24)])
    plan = plan_recompute(low, [(0, 0), (1, 0)])
    t = plan.lowered.table
    assert t.spans == ((12, 16), (20, 24))
    prefix = tuple(low.token_ids[:8])
    assert t.anchor_of(0) == prefix + tuple(low.token_ids[8:12])
    assert t.anchor_of(1) == prefix + tuple(low.token_ids[16:20])
    assert plan.ends == (12, 20)


def test_the_last_run_is_left_to_the_request_itself():
    low = _lowered([(8, 16), (16, 24)])
    plan = plan_recompute(low, [(0, 1), (1, 1)])
    assert plan.lowered.table.spans == ((8, 12), (16, 20))
    assert plan.ends == (16,)  # the last block of the last span: nothing cached follows it


def test_choices_first_last_and_a_share():
    low = _lowered([(8, 20), (20, 28)], n=40)
    assert choose_blocks(low, "first") == [(0, 0), (1, 0)]
    assert choose_blocks(low, "last") == [(0, 2), (1, 1)]
    assert choose_blocks(low, 0.0) == []
    # A share: the spans' first blocks first, then the blocks that share the most (rarest) tokens with the text
    # after the spans; ties to the earlier block.
    assert choose_blocks(low, 0.2) == [(0, 0)]  # no block shares a token with what follows
    low.token_ids[36:40] = low.token_ids[20:24]  # the question repeats span 1's first block…
    assert choose_blocks(low, 0.2) == [(1, 0)]  # …which goes first
    assert choose_blocks(low, 0.6) == [(0, 0), (0, 1), (1, 0)]  # then (0, 1), the earliest of the others
    low.token_ids[32:36] = low.token_ids[16:20]  # and now block 2 of span 0 too
    assert choose_blocks(low, 0.6) == [(0, 0), (0, 2), (1, 0)]
    assert len(choose_blocks(low, 1.0)) == 5


def test_question_recomputes_as_many_blocks_as_first_those_the_question_shares_most_with():
    """"question": the blocks the text after the spans shares the most (rarest) tokens with, wherever they sit in
    their spans, at most one per span on average (first's count), none that shares nothing."""
    low = _lowered([(8, 20), (20, 28)], n=40)
    assert choose_blocks(low, "question") == []  # the question shares nothing: nothing recomputed
    low.token_ids[36:40] = low.token_ids[16:20]  # the question repeats span 0's third block…
    assert choose_blocks(low, "question") == [(0, 2)]  # …which is chosen, not span 0's first
    low.token_ids[32:34] = low.token_ids[20:22]  # and half of span 1's first block
    low.token_ids[34:35] = low.token_ids[12:13]  # and a token of span 0's second
    assert choose_blocks(low, "question") == [(0, 2), (1, 0)]  # two spans: two blocks, the most shared
    assert recompute_setting("question") == "question"


def test_first_and_question_recomputes_each_first_block_and_as_many_the_question_shares_most_with():
    """"first+question": every span's first block, and one block more per span on average, those of the others the
    question shares the most with (none that shares nothing) — a count per span, whatever the spans' sizes."""
    low = _lowered([(8, 24), (24, 32), (32, 48)], n=60)  # blocks of 4: 4, 2 and 4 blocks
    assert choose_blocks(low, "first+question") == [(0, 0), (1, 0), (2, 0)]  # nothing shared: the first blocks
    low.token_ids[52:56] = low.token_ids[40:44]  # the question repeats span 2's third block,
    low.token_ids[56:58] = low.token_ids[12:14]  # half of span 0's second
    assert choose_blocks(low, "first+question") == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 2)]
    low.token_ids[58:60] = low.token_ids[8:10]  # a share of span 0's first block changes nothing: it is in anyway
    assert choose_blocks(low, "first+question") == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 2)]
    low.token_ids[48:52] = low.token_ids[16:18] + low.token_ids[20:22]  # and half of span 0's third and fourth
    # four blocks besides the first ones shared, three spans: three more, the most shared first, ties to the earlier
    assert choose_blocks(low, "first+question") == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 2)]
    assert recompute_setting("first+question") == "first+question"
    g = query(docs("j"), "AB", "?", recompute="first+question")
    assert from_json(to_json(g)) == g


def test_the_last_spans_tail_left_as_context_is_not_read_as_the_question():
    low = _lowered([(8, 20), (20, 28)], n=40)
    pad = 999
    # span 1's tail (3 tokens, kept as context after its whole blocks), prepared as tail + padding to a block
    low.prepare_tails[1] = (*low.token_ids[16:19], pad)
    low.token_ids[28:31] = low.token_ids[16:19]  # the tail repeats span 0's third block…
    assert choose_blocks(low, 0.6, pad) == [(0, 0), (0, 1), (1, 0)]  # …no reason to recompute it: ties to (0, 1)
    low.token_ids[36:39] = low.token_ids[16:19]  # the question (after the tail) repeats it: now it is chosen
    assert choose_blocks(low, 0.6, pad) == [(0, 0), (0, 2), (1, 0)]


def test_settings_are_read_and_refused_by_name():
    assert recompute_setting("none") == 0.0
    assert recompute_setting("0.25") == 0.25
    assert recompute_setting("first") == "first"
    for bad in ("middle", "1.5", "-0.1"):
        with pytest.raises(ValueError, match="recompute must be"):
            recompute_setting(bad)
    g = query(docs("j"), "AB", "?", recompute=0.1)
    assert from_json(to_json(g)) == g


# ---------------------------------------------------------------------------------------------- on the engine


def _run(engine, first, second):
    async def scenario():
        await engine.generate(first)
        warm = await engine.generate(second)
        lowered = engine.lower(second)
        plan = engine.generator.recompute_plan(second, lowered)
        cached, toks, lps = await run_with_logprobs(engine, plan.lowered, 5)
        _, toks_plain, lps_plain = await run_with_logprobs(engine, lowered, 5)
        return warm.metrics, lowered, plan, cached, toks, lps, toks_plain, lps_plain

    return asyncio.run(scenario())


@pytest.mark.vllm
@pytest.mark.parametrize("setting", ["first", "last", "question", "first+question", 0.25])
def test_recomputed_blocks_match_the_reference_built_the_same_way(engine, hf_model, setting):
    tag = f"r{setting}"
    d = docs(tag)
    warm, lowered, plan, cached, toks, lps, toks_plain, lps_plain = _run(
        engine,
        query(d, "ABCD", f"Which shelf holds 4 jars ({tag})?"),
        query(d, "CADB", f"Which shelf holds 7 jars of {tag} jam?", recompute=setting),
    )
    assert warm.prepared_spans == 0
    assert plan.blocks, "something was recomputed"
    assert warm.extra["recomputed_tokens"] == plan.tokens
    n = len(lowered.token_ids)
    # Every block was in the cache when the request ran again: the recompute requests had computed the chosen
    # blocks (only the last, partial block and any recomputed run that ends the spans are computed by it).
    tail_start = max([e for _, e in plan.lowered.table.spans], default=0)
    assert cached >= min(tail_start, n - n % 32 if n % 32 else n - 32)
    ref = span_reference_logprobs(hf_model, lowered.token_ids, plan.lowered.table, toks).double()
    assert (lps - ref).abs().max().item() < TOL
    # The check can fail: without recompute the reference is another, and so is an engine that ignores it.
    plain_ref = span_reference_logprobs(hf_model, lowered.token_ids, lowered.table, toks).double()
    assert (ref - plain_ref).abs().max().item() > 2 * TOL  # 3e-2 for first and 0.25, 6e-4 for last (engine: 1e-6)
    if toks_plain == toks:
        assert (lps_plain - ref).abs().max().item() > 2 * TOL


@pytest.mark.vllm
def test_recomputed_kv_never_lands_under_a_span_key(engine, hf_model):
    """After queries with recompute, the documents' span keys still lead to isolated KV: a query without recompute
    reads them as the plain span reference."""
    d = docs("iso")

    async def scenario():
        await engine.generate(query(d, "ABCD", "Which shelf holds 2 jars?", recompute=1.0))
        await engine.generate(query(d, "DCBA", "Which shelf holds 3 jars?", recompute="first"))
        second = query(d, "BDAC", "Which shelf holds 9 jars?", recompute=0)
        warm = await engine.generate(second)
        lowered = engine.lower(second)
        return warm.metrics, lowered, *await run_with_logprobs(engine, lowered, 5)

    warm, lowered, _cached, toks, lps = asyncio.run(scenario())
    assert warm.prepared_spans == 0
    ref = span_reference_logprobs(hf_model, lowered.token_ids, lowered.table, toks).double()
    assert (lps - ref).abs().max().item() < TOL


@pytest.mark.vllm
def test_a_call_that_says_nothing_gets_its_engines_setting(engine):
    """One default (`recompute.DEFAULT_RECOMPUTE`, "first+question") on the embedded engine and `spanq serve` alike; an
    engine configured otherwise (here `"first"`) applies its setting to every call that says nothing, and a call's
    own setting (`recompute=0`) wins."""
    from spanq_backend.serving.engine import EngineConfig
    from spanq_backend.serving.recompute import DEFAULT_RECOMPUTE
    from spanq_backend.serving.server import parse_serve_args

    assert EngineConfig().recompute == DEFAULT_RECOMPUTE == parse_serve_args(["--model", "tiny"]).spanq_recompute == "first+question"
    d = docs("default")
    lowered = engine.lower(query(d, "ABCD", "Which shelf holds 5 jars?"))
    plan = engine.generator.recompute_plan(query(d, "ABCD", "?"), lowered)
    first = engine.generator.recompute_plan(query(d, "ABCD", "?", recompute="first"), lowered)
    assert plan.blocks == first.blocks == tuple((i, 0) for i in range(4))
    assert engine.generator.recompute_plan(query(d, "ABCD", "?", recompute=0), lowered).blocks == ()


@pytest.mark.vllm
def test_recompute_zero_keeps_todays_results_bit_for_bit(engine):
    d = docs("zero")
    first = query(d, "ABCD", "Which shelf holds 1 jar?", recompute=0)

    async def scenario():
        await engine.generate(first)
        out = []
        for setting in (0, 0.0):
            second = query(d, "DBCA", "Which shelf holds 6 jars?", recompute=setting)
            lowered = engine.lower(second)
            plan = engine.generator.recompute_plan(second, lowered)
            assert plan.lowered.table == lowered.table and plan.ends == ()
            res = await engine.generate(second)
            out.append((res.texts, res.metrics.extra["recomputed_tokens"], await run_with_logprobs(engine, lowered, 5)))
        return out

    (texts, n0, (c0, t0, l0)), *rest = asyncio.run(scenario())
    assert n0 == 0
    for texts_k, n_k, (c_k, t_k, l_k) in rest:  # every spelling of "nothing recomputed" is that one layout
        assert texts_k == texts and n_k == 0 and c_k == c0 and t_k == t0
        assert torch.equal(l_k, l0)


@pytest.mark.vllm
def test_every_recomputed_run_and_the_answer_are_computed_in_one_engine_step(engine, hf_model):
    """The recompute requests and the call's own request go to the engine together: the answer's first token
    comes out of the call's first engine step, each run computes only its own block (the runs before it are
    cache hits registered in that same step), and the answer, which reads the runs' K/V computed in that step,
    equals the HF reference built the same way."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    d = docs("oneround")
    gen = engine.generator

    async def scenario():
        await engine.generate(query(d, "ABCD", "Which shelf holds 4 jars?"))  # spans cached
        second = query(d, "DBAC", "Which shelf holds 8 jars?", recompute="first")
        lowered = engine.lower(second)
        plan = gen.recompute_plan(second, lowered)
        params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, output_kind=RequestOutputKind.DELTA)
        with engine.batch():
            runs = gen.open_recompute(plan)
            answer = gen.open(lowered.token_ids, params, plan.lowered.table)
        computed = await asyncio.gather(*(gen._computed(end, o) for end, o in runs))
        out = await gen.consume(answer)
        # The call itself, in another order (nothing recomputed is cached): which steps its requests ran in.
        third = query(d, "CDBA", "Which shelf holds 9 jars?", recompute="first")
        engine.recent.clear()
        done = await engine.generate(third)
        return lowered, plan, computed, out, list(engine.recent), done.metrics, gen.recompute_plan(third, engine.lower(third))

    with temporarily(gen, keep_span_order=True):  # three layouts of one set (by default one: the third would find the runs cached)
        lowered, plan, computed, out, requests, metrics, plan3 = asyncio.run(scenario())
    assert len(plan.ends) >= 3 and len(plan3.ends) >= 3, "several runs that span blocks follow"
    assert computed == [32] * len(plan.ends), "each run computed its own block only"
    assert len(requests) == len(plan3.ends) + 1  # nothing prepared: the runs and the answer
    first_steps = {r.first_output_step - r.added_at_step for r in requests}
    assert first_steps == {1}, f"steps from submission to first output: {first_steps} (one round: 1 for every request)"
    assert len({r.added_at_step for r in requests}) == 1, "all submitted before the same step"
    assert metrics.prepared_tokens == 32 * len(plan3.ends), "no run computed more than its block"
    toks = out.token_ids
    lps = torch.tensor([lp[t].logprob for o in out.outputs for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
                       dtype=torch.float64)
    ref = span_reference_logprobs(hf_model, lowered.token_ids, plan.lowered.table, toks).double()
    assert (lps - ref).abs().max().item() < TOL
