"""Cold spans (docs/design.md, "Cold spans"): a query whose documents are not cached yet computes them in context,
as a stock prompt does — its answer is stock's — and prepares them alone when the engine is idle, so the next
query reads them from the cache; documents that are cached are read first, the new ones after them.

Checked on the engine against the HF reference: the cold answer is the stock answer on the same tokens; after the
deferred prepares, a reordered query is all cache hits and matches the span reference (the in-context KV of the
cold query never landed under a span's key); a query mixing cached and new documents reads the cached ones as
spans and the new ones as context, and matches the reference of that layout.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.hf_span import full_attention_logprobs, span_reference_logprobs
from spanq_backend.serving import metrics
from spanq_backend.serving.generator import flattened_prompt_ids
from spanq_backend.serving.lowering import lower
from spanq_integrations import cross, fragment, generate, plus, system, user
from tests.backend.logprobs import run_with_logprobs
from tests.backend.settings import temporarily

pytestmark = pytest.mark.vllm

TOL = 2e-4


def docs(tag: str) -> dict[str, str]:
    return {c: f"Card {c}{tag}. " + " ".join(f"Drawer {c}{tag}-{i} keeps {i * 3 % 7} keys." for i in range(12))
            for c in "ABCD"}


def query(d: dict[str, str], order: str, question: str = "Which drawer keeps 5 keys?", instruction: str = "Answer from the cards."):
    return generate(
        cross(system(instruction), plus(*[fragment(d[c]) for c in order]), user(question)),
        max_tokens=5, temperature=0.0,
    )


@pytest.fixture(scope="module")
def engine(tiny_model):
    from spanq_backend.serving.engine import SpanEngine

    # recompute=0: these tests compare answers with the span reference (recomputing is test_recompute.py's subject)
    eng = SpanEngine(model=str(tiny_model), block_size=32, max_model_len=2048, max_num_seqs=8, cold_spans="context",
                     recompute=0)
    yield eng
    eng.close()


def test_a_cold_query_answers_as_stock_and_prepares_its_documents_when_idle(engine, hf_model):
    d = docs("cold")
    gen = engine.generator

    async def scenario():
        first = query(d, "ABCD")
        layout = await gen.layout(first)
        cold = await engine.generate(first)
        stock = await run_with_logprobs(engine, layout.lowered, 5, with_table=False)
        engine.settle()
        # Another instruction: the prefix cache does not hold these documents in context after it, so the spans
        # are what the query reads (the same instruction is `test_documents_read_in_context_...`'s case).
        second = query(d, "DBCA", "Which drawer keeps 2 keys?", instruction="Answer from these cards.")
        warm_layout = await gen.layout(second)
        warm = await engine.generate(second)
        return first, layout, cold, stock, warm_layout, warm, await run_with_logprobs(engine, warm_layout.lowered, 5)

    first, layout, cold, (_, stock_toks, _), warm_layout, warm, (_, toks, lps) = asyncio.run(scenario())
    m = cold.metrics
    assert layout.mode == "context" and m.extra["cold_spans"] == "context"
    assert m.prepared_spans == 0 and m.deferred_spans == 4 and m.padded_tokens == 0
    # Nothing of the span layout is left: the prompt is the one a stock engine reads, and so is the answer.
    assert layout.lowered.token_ids == flattened_prompt_ids(engine.tokenizer, first.input)
    assert not layout.lowered.has_spans
    assert cold.texts[0] == engine.tokenizer.decode(stock_toks)
    # After the deferred prepares: every document a cache hit, read as an isolated span.
    w = warm.metrics
    assert warm_layout.mode == "warm" and w.extra["cold_spans"] == "warm" and w.prepared_spans == 0
    assert w.cached_tokens >= sum(e - s for s, e in warm_layout.lowered.table.spans) > 0
    ref = span_reference_logprobs(hf_model, warm_layout.lowered.token_ids, warm_layout.lowered.table, toks).double()
    assert (lps - ref).abs().max().item() < TOL


def test_cached_documents_are_read_first_and_new_ones_in_context_after_them(engine, hf_model):
    d = docs("mixed")
    gen = engine.generator

    async def scenario():
        await engine.generate(query(d, "AB"))
        engine.settle()  # A and B are spans in the cache now
        mixed = query(d, "CADB")
        layout = await gen.layout(mixed)
        result = await engine.generate(mixed)
        return layout, result, await run_with_logprobs(engine, layout.lowered, 5)

    layout, result, (_, toks, lps) = asyncio.run(scenario())
    table = layout.lowered.table
    assert layout.mode == "context" and len(layout.deferred) == 2
    assert len(table.spans) == 2, "A and B are spans; C and D are context"
    text = engine.tokenizer.decode(layout.lowered.token_ids)
    assert text.index("Card Amixed") < text.index("Card Bmixed") < text.index("Card Cmixed") < text.index("Card Dmixed")
    assert result.metrics.cached_tokens >= sum(e - s for s, e in table.spans)
    assert result.texts[0] == engine.tokenizer.decode(toks)
    ref = span_reference_logprobs(hf_model, layout.lowered.token_ids, table, toks).double()
    assert (lps - ref).abs().max().item() < TOL
    # The check can fail: reading C and D as spans too is another computation.
    everything = gen._lower(query(d, "ABCD"))[0]
    other = span_reference_logprobs(hf_model, everything.token_ids, everything.table, toks).double()
    assert (other - ref).abs().max().item() > 2 * TOL


def test_documents_read_in_context_before_are_read_so_again_in_any_order_and_answer_as_stock(engine, hf_model):
    """A query whose documents the prefix cache holds in context (an earlier query read them cold, in context, in
    another order) is read as stock reads them, in the order the cache holds, where that computes at most a block more than the
    span layout: stock's speed, and full attention's answer (docs/design.md, "Read in context again")."""
    d = docs("again")
    gen = engine.generator
    question = "Which drawer keeps 6 keys?"

    async def scenario():
        await engine.generate(query(d, "ABCD"))  # cold: read in context, in this order
        engine.settle()
        again = query(d, "DBCA", question)
        layout = await gen.layout(again)
        before = metrics.snapshot()
        result = await engine.generate(again)
        counted = {k: v - before[k] for k, v in metrics.snapshot().items() if k in before}
        spans_layout = gen._lower(again)[0]
        isolated = await gen.layout(again.model_copy(update={"cold_spans": "isolate"}))
        logprobs = await run_with_logprobs(engine, layout.lowered, 5, with_table=False)
        return layout, result, spans_layout, isolated, logprobs, counted

    layout, result, spans_layout, isolated, (_, toks, lps), counted = asyncio.run(scenario())
    m = result.metrics
    assert layout.mode == "in-context" and m.extra["cold_spans"] == "in-context"
    # `/metrics` counts it as read in context, not as a span call whose four documents were hits (it read none).
    assert counted["in_context_calls"] == 1 and counted["span_calls"] == 0 and counted["spans_hit"] == 0, counted
    # A call that asks for answers independent of what was read before (a judge: "isolate") reads spans.
    assert isolated.mode == "warm" and isolated.lowered.has_spans
    # The stock prompt, in the order the cache holds (ABCD), with the new question.
    assert layout.lowered.token_ids == flattened_prompt_ids(engine.tokenizer, query(d, "ABCD", question).input)
    assert not layout.lowered.has_spans and m.padded_tokens == 0 and m.prepared_spans == 0
    # Every document found cached; it computes at most a block more than the span layout would, every span cached.
    span_computes = len(spans_layout.token_ids) - sum(e - s for s, e in spans_layout.table.spans)
    span_computes -= spans_layout.table.spans[0][0]
    assert m.prompt_tokens - m.cached_tokens <= span_computes + 32
    asked = len(engine.tokenizer.encode(question, add_special_tokens=False)) + 16  # the question, the turn's end
    assert m.cached_tokens >= m.prompt_tokens - asked - 32
    # Full attention's answer, the HF reference's on the same tokens.
    assert result.texts[0] == engine.tokenizer.decode(toks)
    ref = full_attention_logprobs(hf_model, layout.lowered.token_ids, toks).double()
    assert (lps - ref).abs().max().item() < TOL
    # The check can fail: the same query read as spans answers otherwise (span attention).
    as_spans = span_reference_logprobs(hf_model, spans_layout.token_ids, spans_layout.table, toks).double()
    assert (as_spans - ref).abs().max().item() > 2 * TOL


def few_drawers(tag: str, drawers: int) -> dict[str, str]:
    return {c: f"Card {c}{tag}. " + " ".join(f"Drawer {c}{tag}-{i} keeps {i * 3 % 7} keys." for i in range(drawers))
            for c in "ABCD"}


def test_small_cached_documents_that_the_default_recomputes_almost_whole_are_read_as_the_stock_prompt(engine, hf_model):
    """Every span cached, at the default recompute: where the span layout would compute nearly as much as the stock
    prompt (small documents, most of whose blocks are recomputed in context, plus padding and moves), the call reads
    the stock prompt in the order given: stock's computation and full attention's answer. Larger documents, most of
    whose blocks are read from the cache, stay spans (docs/design.md, "Small documents read again")."""
    gen = engine.generator
    question, other = "Which drawer keeps 3 keys?", "Answer from these cards."  # not in context after the cold read

    async def scenario(d):
        await engine.generate(query(d, "ABCD"))
        engine.settle()  # the deferred prepares: every document cached as a span
        subset = query(d, "DBC", question, instruction=other)
        layout = await gen.layout(subset)
        spans_layout = gen._lower(subset)[0]
        counted = gen.span_computes(subset, spans_layout)
        before, planned, plan = metrics.snapshot(), [], gen.recompute_plan
        with temporarily(gen, recompute_plan=lambda *a, **k: planned.append(1) or plan(*a, **k)):
            result = await engine.generate(subset)
        calls = {k: v - before[k] for k, v in metrics.snapshot().items() if k in before}
        calls["recompute_plans"] = len(planned)
        logprobs = await run_with_logprobs(engine, layout.lowered, 5, with_table=layout.lowered.has_spans)
        again = await gen.layout(query(d, "CBD", "Which drawer keeps 1 key?", instruction=other))
        return subset, layout, counted, result, logprobs, again, calls

    with temporarily(gen, default_recompute="first+question"):
        subset, layout, counted, result, (_, toks, lps), again, calls = asyncio.run(scenario(few_drawers("small", 3)))
        m = result.metrics
        assert layout.mode == "stock" and m.extra["cold_spans"] == "stock" and m.prepared_spans == 0
        # `/metrics`: a call that read no span, none of its documents counted as a hit
        assert calls["in_context_calls"] == 1 and calls["span_calls"] == 0 and calls["spans_hit"] == 0, calls
        assert layout.lowered.token_ids == flattened_prompt_ids(engine.tokenizer, subset.input)
        assert m.padded_tokens == 0 and m.extra["recomputed_tokens"] == 0
        assert m.prompt_tokens - m.cached_tokens <= gen.STOCK_READ_FACTOR * counted + 32  # what the rule allows
        ref = full_attention_logprobs(hf_model, layout.lowered.token_ids, toks).double()
        assert (lps - ref).abs().max().item() < TOL and result.texts[0] == engine.tokenizer.decode(toks)
        # Read so, the set is in context in that order: the next call over it, in any order, reads it so again.
        assert again.mode == "in-context"

        # Larger documents: two of each one's four blocks recomputed, the rest read from the cache: spans. What the
        # span layout computes is what the engine computed (recomputed blocks included).
        subset, layout, counted, result, *_, calls = asyncio.run(scenario(few_drawers("large", 12)))
        m = result.metrics
        assert layout.mode == "warm" and m.extra["recomputed_tokens"] > 0
        assert calls["span_calls"] == 1 and calls["spans_hit"] == 3 and calls["in_context_calls"] == 0, calls
        assert m.prompt_tokens - m.cached_tokens == counted
        # The recompute plan is worked out once per call: where the layout counted it, the answer runs that one.
        assert calls["recompute_plans"] == 1, calls

        # The check can fail: with the rule off, the small documents are read as spans, padded, most recomputed.
        with temporarily(gen, STOCK_READ_FACTOR=0.0):
            _, layout, counted, result, *_ = asyncio.run(scenario(few_drawers("small-off", 3)))
        assert layout.mode == "warm" and result.metrics.padded_tokens > 0 and result.metrics.extra["recomputed_tokens"] > 0

        # Two of them cached and a new one: the new one is computed in context (and prepared when idle), and the
        # cached ones save too little beside it: the stock prompt, in the order given.
        d, new = few_drawers("small", 3), few_drawers("small-new", 3)["A"]

        def mixed(tag: str):
            return generate(cross(system(other), plus(fragment(d["D"]), fragment(new + tag), fragment(d["B"])),
                                  user(question)), max_tokens=5, temperature=0.0)

        layout = asyncio.run(gen.layout(mixed("")))
        assert layout.mode == "context" and not layout.lowered.has_spans and len(layout.deferred) == 1
        assert layout.lowered.token_ids == flattened_prompt_ids(engine.tokenizer, mixed("").input)
        with temporarily(gen, STOCK_READ_FACTOR=0.0):  # the rule off: the cached two read as spans
            layout = asyncio.run(gen.layout(mixed(" ")))
        assert layout.mode == "context" and layout.lowered.has_spans


def test_documents_prepared_alone_first_are_read_in_context_when_idle_and_so_again_in_any_order(engine, hf_model):
    """A cold query whose documents are prepared alone first (`auto`, above `isolate_min_tokens`) answers from the
    spans; when the engine is idle the stock prompt over its documents, in the order the spans read them, is
    computed too. The next query over the same set, in any order, with another question, is read in context as
    stock canonical reads it: full attention's answer, nothing recomputed or moved (docs/design.md, "Read in
    context again")."""
    gen = engine.generator
    question = "Which drawer keeps 4 keys?"

    async def scenario(d):
        cold = await engine.generate(query(d, "ABCD"))
        engine.settle()
        again = query(d, "CADB", question)
        layout = await gen.layout(again)
        result = await engine.generate(again)
        logprobs = await run_with_logprobs(engine, layout.lowered, 5, with_table=False)
        return cold, gen._lower(query(d, "ABCD"))[0], layout, result, logprobs

    with temporarily(gen, cold_spans="auto", isolate_min_tokens=1):
        d = docs("later")
        cold, lowered, layout, result, (_, toks, lps) = asyncio.run(scenario(d))
        iso = query(d, "ABCD").model_copy(update={"cold_spans": "isolate"})
        assert gen.in_context_later(iso, gen._lower(iso)[0]) is None, "a call that asks isolate never reads so"
    assert cold.metrics.extra["cold_spans"] == "isolate" and cold.metrics.prepared_spans == 4
    assert layout.mode == "in-context" and result.metrics.extra["cold_spans"] == "in-context"
    # The stock prompt with the documents in the order the spans read them, found cached up to the question.
    order = "".join(sorted("ABCD", key=lambda c: lowered.span_texts.index(docs("later")[c])))
    assert layout.lowered.token_ids == flattened_prompt_ids(engine.tokenizer, query(d, order, question).input)
    m = result.metrics
    asked = len(engine.tokenizer.encode(question, add_special_tokens=False)) + 16
    assert m.cached_tokens >= m.prompt_tokens - asked - 32 and m.prepared_spans == 0 and m.padded_tokens == 0
    assert m.extra["recomputed_tokens"] == 0
    ref = full_attention_logprobs(hf_model, layout.lowered.token_ids, toks).double()
    assert (lps - ref).abs().max().item() < TOL
    assert result.texts[0] == engine.tokenizer.decode(toks)

    # The check can fail: without the stock prompt computed when idle, the same scenario reads the spans.
    with temporarily(gen, cold_spans="auto", isolate_min_tokens=1, in_context_later=lambda *a: None):
        *_, layout, result, _ = asyncio.run(scenario(docs("later-off")))
    assert layout.mode == "warm" and result.metrics.extra["cold_spans"] == "warm"


def test_documents_no_longer_cached_in_context_are_read_as_spans(engine, hf_model):
    """The order remembered is only a guess of what the cache holds: once the in-context blocks are gone (evicted,
    reset), the same query is not read in context (it would compute everything) but as spans, prepared anew."""
    d = docs("gone")
    gen = engine.generator

    async def scenario():
        await engine.generate(query(d, "ABCD"))
        engine.settle()
        assert engine.reset_prefix_cache()
        again = query(d, "CADB", "Which drawer keeps 3 keys?")
        return await gen.layout(again), await engine.generate(again)

    layout, result = asyncio.run(scenario())
    assert layout.mode != "in-context" and result.metrics.extra["cold_spans"] != "in-context"
    assert result.metrics.deferred_spans + result.metrics.prepared_spans == 4


def test_isolate_prepares_cold_spans_first_and_answers_as_the_warm_spans_do(engine, hf_model):
    d = docs("iso")
    gen = engine.generator
    gen.cold_spans = "isolate"

    own = "Answer from the cards (isolated)."  # a prefix no other test's query left in the cache

    async def scenario():
        cold = await engine.generate(query(d, "ABCD", instruction=own))
        layout = await gen.layout(query(d, "ABCD", instruction=own))  # all cached now
        return cold, layout, await run_with_logprobs(engine, layout.lowered, 5)

    try:
        cold, layout, (_, toks, lps) = asyncio.run(scenario())
    finally:
        gen.cold_spans = "context"
    m = cold.metrics
    assert m.extra["cold_spans"] == "isolate" and m.prepared_spans == 4 and m.deferred_spans == 0
    assert m.cached_tokens == 0 and m.prepared_tokens > 0
    # The cold answer is the span answer: the one the same query gives warm, which is the HF span reference's.
    assert layout.mode == "warm"
    ref = span_reference_logprobs(hf_model, layout.lowered.token_ids, layout.lowered.table, toks).double()
    assert (lps - ref).abs().max().item() < TOL
    assert cold.texts[0] == engine.tokenizer.decode(toks)


def test_a_query_right_after_a_cold_one_waits_for_its_documents_prepares_and_reads_them_as_spans(engine):
    """No settling between the two: the second query finds its documents' deferred prepares under way and waits
    for them rather than reading the documents in context again."""
    d = docs("next")

    other = "Answer from these cards."  # not the cold query's: its documents are not cached in context after it

    async def scenario():
        cold = await engine.generate(query(d, "ABCD"))
        warm = await engine.generate(query(d, "CDAB", "Which drawer keeps 1 key?", instruction=other))
        return cold.metrics, warm.metrics

    cold, warm = asyncio.run(scenario())
    assert cold.deferred_spans == 4
    assert warm.extra["cold_spans"] == "warm" and warm.deferred_spans == 0 and warm.prepared_spans == 0
    lowered = engine.lower(query(d, "CDAB", "Which drawer keeps 1 key?", instruction=other))
    assert warm.cached_tokens >= sum(e - s for s, e in lowered.table.spans)


def test_the_default_isolates_only_large_cold_prompts(engine):
    """`cold_spans="auto"`, the default: a few small new documents are computed in context (stock's speed and
    stock's answer, prepared when idle); as many cold tokens as `isolate_min_tokens` are prepared alone first."""
    from spanq_backend.serving.engine import EngineConfig
    from spanq_backend.serving.generator import ISOLATE_MIN_TOKENS

    assert EngineConfig().cold_spans == "auto"
    gen = engine.generator
    gen.cold_spans = "auto"

    async def scenario():
        small = await engine.generate(query(docs("auto-s"), "ABCD"))
        gen.isolate_min_tokens = 1  # any cold token is "large"
        large = await engine.generate(query(docs("auto-l"), "ABCD"))
        return small.metrics, large.metrics

    try:
        small, large = asyncio.run(scenario())
    finally:
        gen.cold_spans, gen.isolate_min_tokens = "context", ISOLATE_MIN_TOKENS
    assert small.extra["cold_spans"] == "context" and small.prepared_spans == 0 and small.deferred_spans == 4
    assert large.extra["cold_spans"] == "isolate" and large.prepared_spans == 4 and large.deferred_spans == 0


def test_a_call_that_recomputes_blocks_isolates_its_cold_spans_only_from_the_larger_threshold(engine, monkeypatch):
    """A call that recomputes span blocks (the default `first+question`) computes again, in context, some of what
    isolating its cold spans saved: "auto" isolates it only from `ISOLATE_MIN_TOKENS_RECOMPUTING` cold tokens
    (docs/benchmarks.md, "Cold spans at the default recompute"). Below that it reads them in context — stock's
    prompt and answer — where a call that recomputes nothing, over as many cold tokens, is prepared alone first."""
    from spanq_backend.serving import generator as generator_module

    gen = engine.generator
    gen.cold_spans = "auto"
    recomputing = {"recompute": "first+question"}

    async def scenario():
        gen.isolate_min_tokens = 1  # any cold token reaches the threshold of a call that recomputes nothing
        plain = await engine.generate(query(docs("rc-0"), "ABCD"))
        engine.settle()
        fq = await engine.generate(query(docs("rc-fq"), "ABCD").model_copy(update=recomputing))
        engine.settle()
        monkeypatch.setattr(generator_module, "ISOLATE_MIN_TOKENS_RECOMPUTING", 1)
        large = await engine.generate(query(docs("rc-large"), "ABCD").model_copy(update=recomputing))
        return plain.metrics, fq.metrics, large.metrics

    try:
        plain, fq, large = asyncio.run(scenario())
    finally:
        gen.cold_spans, gen.isolate_min_tokens = "context", generator_module.ISOLATE_MIN_TOKENS
        engine.settle()
    assert plain.extra["cold_spans"] == "isolate" and plain.prepared_spans == 4
    assert fq.extra["cold_spans"] == "context" and fq.prepared_spans == 0 and fq.deferred_spans == 4
    assert fq.extra["recomputed_tokens"] == 0  # read in context: nothing of the documents is a span to recompute
    assert large.extra["cold_spans"] == "isolate" and large.prepared_spans == 4 and large.extra["recomputed_tokens"] > 0


def test_cold_spans_a_tier_holds_in_part_are_isolated_from_the_threshold_without_recompute(engine):
    """On an engine with a span tier, a call some of whose cold spans the tier holds keeps the threshold measured
    without recompute (its prepares load those and compute the rest alone, as before the larger threshold of calls
    that recompute); one whose cold spans the tier holds none of gets the larger one, and all of them: isolated."""
    gen = engine.generator
    lowered = engine.lower(query(docs("tier-part"), "ABCD"))
    cold = gen.cold_span_indices(lowered)
    first = lowered.prepare_prompt(cold[0])
    larger = 10**6  # a recomputing call's threshold, out of reach of these cards
    with temporarily(gen, isolate_min_tokens=1):
        with temporarily(gen, span_in_tier=lambda prompt: prompt == first):
            assert gen.cold_policy(lowered, cold, "auto", larger) == "isolate"
        with temporarily(gen, span_in_tier=lambda prompt: False):
            assert gen.cold_policy(lowered, cold, "auto", larger) == "context"
        with temporarily(gen, span_in_tier=lambda prompt: True):
            assert gen.cold_policy(lowered, cold, "auto", larger) == "isolate"


def test_a_call_says_how_its_own_cold_spans_are_computed(engine):
    """`generate(..., cold_spans=...)` overrides the engine's policy for that call only (judges ask "isolate"):
    on this "context" engine, the call's cold documents are prepared alone first; the next call is as before."""
    d, e = docs("own"), docs("own2")

    async def scenario():
        own = await engine.generate(query(d, "ABCD").model_copy(update={"cold_spans": "isolate"}))
        engine_default = await engine.generate(query(e, "ABCD"))
        return own.metrics, engine_default.metrics

    own, engine_default = asyncio.run(scenario())
    assert own.extra["cold_spans"] == "isolate" and own.prepared_spans == 4 and own.deferred_spans == 0
    assert engine_default.extra["cold_spans"] == "context" and engine_default.deferred_spans == 4


def test_a_prompt_that_fits_only_without_the_span_padding_is_read_as_stock_reads_it(engine):
    """Retrieved documents filled to just under the context window: stock vLLM answers, and so must the span
    engine — its padding (up to a block less one token a document) would push the span layout past the window,
    and the call was a `ContextLengthError` once any of its documents had been seen (or on its first call, under
    "isolate" or past `isolate_min_tokens`). Now it is read in context as stock reads it; its documents that fit
    alone are prepared when idle. A prompt stock cannot fit either is still refused, with stock's sizes."""
    from spanq_integrations.query.errors import ContextLengthError

    tokenizer = engine.tokenizer
    cards = [f"Card {k}. " + " ".join(f"Shelf {k}-{i} holds {i % 5} jars." for i in range(11)) for k in range(17)]

    def fill(n: int):
        return generate(cross(system("Answer from the cards."), plus(*cards[:n]), user("Which shelf holds 3 jars?")),
                        max_tokens=4, temperature=0.0)  # fmt: skip

    n = max(k for k in range(1, len(cards) + 1)
            if len(flattened_prompt_ids(tokenizer, fill(k).input)) + 4 <= engine.config.max_model_len)  # fmt: skip
    call = fill(n)
    stock_ids = flattened_prompt_ids(tokenizer, call.input)
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    laid_out = lower(call.input, tokenizer, 32, newline, None)  # the span layout, unchecked
    assert len(laid_out.token_ids) + 4 > engine.config.max_model_len >= len(stock_ids) + 4, "not the case tested"

    async def scenario():
        seen = await engine.generate(fill(1))  # one of its documents laid out before: the full layout is tried
        engine.settle()
        answer = await engine.generate(call)
        engine.settle()
        return seen, answer

    _, answer = asyncio.run(scenario())
    m = answer.metrics
    assert m.prompt_tokens == len(stock_ids) and m.padded_tokens == 0 and m.extra["cold_spans"] == "context"
    assert m.deferred_spans == n - 1, m  # every card but the one read before: prepared alone when idle
    # Asked again in another order, with another question: its documents are held in context in the order read,
    # so it is read so, as a cache hit (it was read in context again in the order given, computing them all).
    question = "Which shelf holds 4 jars?"
    again = asyncio.run(engine.generate(generate(
        cross(system("Answer from the cards."), plus(*reversed(cards[:n])), user(question)), max_tokens=4, temperature=0.0,
    )))  # fmt: skip
    a = again.metrics
    assert a.extra["cold_spans"] == "in-context" and a.deferred_spans == 0 and a.padded_tokens == 0, a
    same_order = generate(cross(system("Answer from the cards."), plus(*cards[:n]), user(question)), max_tokens=4)
    assert a.prompt_tokens == len(flattened_prompt_ids(tokenizer, same_order.input))
    assert a.cached_tokens >= a.prompt_tokens - len(tokenizer.encode(question, add_special_tokens=False)) - 16 - 32
    with pytest.raises(ContextLengthError, match="context"):
        asyncio.run(engine.generate(fill(n + 1)))

    # The same, the first time any of its documents is seen (read in context at once; its prepares worked out
    # after the answer): they are prepared too, so a shorter prompt over two of them reads both from the cache.
    cards[:] = [card.replace("Shelf", "Tile") for card in cards]

    async def first_seen():
        await engine.generate(fill(n))
        engine.settle()
        short = generate(cross(system("Answer from the cards."), plus(cards[3], cards[7]), user("Which tile?")),
                         max_tokens=2, temperature=0.0)  # fmt: skip
        return await engine.generator.layout(short)

    assert asyncio.run(first_seen()).mode == "warm"


def test_a_document_whose_padded_last_block_alone_was_evicted_is_still_read_from_the_cache(engine):
    """The last document of a prompt keeps its partial last block as context: the answer computes it, and never
    reads the padded copy its prepare cached. vLLM frees a request's last blocks first, so that copy goes first;
    with it gone the whole document counted as cold, and was read in context again (another answer) or prepared
    again. Only the blocks the prompt reads decide now."""
    d = docs("tail-evicted")
    gen = engine.generator
    manager = engine.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager

    async def scenario():
        await engine.generate(query(d, "ABCD"))
        engine.settle()  # the deferred prepares: every document cached alone
        second = query(d, "DBCA", "Which drawer keeps 2 keys?", instruction="Answer from these cards.")
        before = await gen.layout(second)
        (last,) = before.lowered.prepare_tails  # the span whose padded last block the prompt does not read
        tail_hash = gen.span_probe.block_hashes(before.lowered.prepare_prompt(last))[-1]
        (block,) = manager.block_pool.get_cached_block(tail_hash, [0])
        manager.evict_blocks({block.block_id})
        assert not gen.span_cached(before.lowered.prepare_prompt(last))  # gone from the cache
        return before, await gen.layout(second)

    before, after = asyncio.run(scenario())
    assert before.mode == "warm" and after.mode == "warm", after.mode
    assert after.lowered.token_ids == before.lowered.token_ids


def probes_and_requests(engine, d: dict[str, str], order: str = "ABCD", question: str = "Which drawer keeps 5 keys?") -> tuple[list[str], object]:
    """Run a query on documents `d` and record, in order, each cache probe of a prompt and each request sent to
    the engine (spies on the engine's real probe and submission: what they do is unchanged). In "context" the
    first request is the answer's."""
    # The deferred prepares an earlier test left probe the cache from the engine's thread when it is idle (they
    # skip what is cached by now): done first, so that what is recorded is this query's own doing.
    assert engine.settle()
    gen = engine.generator
    events: list[str] = []
    probe, real_hashes, real_open = gen.span_probe, gen.span_probe.block_hashes, gen.open

    def hashes(token_ids):
        events.append("probe")
        return real_hashes(token_ids)

    def opened(*args, **kwargs):
        events.append("request")
        return real_open(*args, **kwargs)

    probe.block_hashes, gen.open = hashes, opened
    try:
        completion = asyncio.run(engine.generate(query(d, order, question)))
    finally:
        del probe.block_hashes, gen.open
    engine.settle()
    return events, completion


def test_new_documents_read_in_context_cost_no_span_layout_before_the_answer(engine, monkeypatch):
    """Documents this engine never laid out cannot be cached: their span layout, cache probes and prepare prompts
    are worked out after the answer (tokenizing and hashing every document again before the answer was 3-14 ms
    beside stock's own prompt time on tiny). They are still prepared, so the next query reads them as spans."""
    events, cold = probes_and_requests(engine, docs("unseen"))
    assert events[0] == "request" and "probe" in events, events  # probed, for the deferred prepares, after
    assert cold.metrics.extra["cold_spans"] == "context" and cold.metrics.deferred_spans == 4
    # (under another instruction: after the cold query's own, the documents are read in context again)
    warm = asyncio.run(engine.generate(query(docs("unseen"), "BADC", instruction="Answer from these cards.")))
    assert warm.metrics.extra["cold_spans"] == "warm" and warm.metrics.prepared_spans == 0
    # The check can fail: laid out in full first (the way before), the documents are probed before the answer.
    monkeypatch.setattr(engine.generator, "unseen_in_context", lambda *a, **k: None)
    events, _ = probes_and_requests(engine, docs("unseen-full"))
    assert events[0] == "probe", events


def test_documents_read_in_context_again_cost_no_span_layout_before_the_answer(engine, monkeypatch):
    """A set read in context before, asked about again in another order, is read as stock reads it, and that is
    decided on the stock prompt alone: the span layout, its hashes and the span probes (1-3 ms of a 70-110 ms
    warm query at 8 documents on SmolLM2, the only work stock canonical does not do) come after the answer. The
    spans the cache lacks are still found then and prepared when idle."""
    d = docs("seen")
    gen = engine.generator
    with temporarily(gen, defer=lambda *a, **k: None):  # read in context, nothing prepared: no span is cached
        first = asyncio.run(engine.generate(query(d, "ABCD")))
    assert first.metrics.extra["cold_spans"] == "context"
    events, again = probes_and_requests(engine, d, "CADB", "Which drawer keeps 6 keys?")
    m = again.metrics
    assert m.extra["cold_spans"] == "in-context" and m.prepared_spans == 0 and m.padded_tokens == 0
    assert events[0] == "request" and "probe" in events, events  # probed after the answer, for the prepares
    assert m.deferred_spans == 4, "the four spans the cache lacks are prepared when idle"
    # ... so that another set or order reads them as spans.
    other = asyncio.run(engine.generate(query(d, "DBCA", instruction="Answer from these cards.")))
    assert other.metrics.extra["cold_spans"] == "warm" and other.metrics.prepared_spans == 0
    # The check can fail: decided on the span layout (the way before), the documents are probed before the answer.
    monkeypatch.setattr(gen, "seen_in_context", lambda *a, **k: (None, None))
    events, again = probes_and_requests(engine, d, "BDAC", "Which drawer keeps 1 key?")
    assert again.metrics.extra["cold_spans"] == "in-context" and events[0] == "probe", events


def test_documents_read_in_context_again_are_not_tokenized_again_before_the_answer(engine, monkeypatch):
    """A set read in context before, asked about again, is the same text up to its documents' end: their tokens,
    kept after the first reading (`PrefixTokens`), are reused and only what follows (the new question) is tokenized
    before the answer (tokenizing the whole stock prompt again was ~7 of the ~12 ms the span engine spent before a
    warm query's request at 8 x 512 on SmolLM2, what stock canonical spends too). The prompt is still exactly the
    whole text's tokenization, and the answer stock's."""
    d = docs("tokens")
    gen = engine.generator
    with temporarily(gen, defer=lambda *a, **k: None):
        asyncio.run(engine.generate(query(d, "ABCD")))  # cold: read in context; the documents' tokens kept

    def tokenized_before_the_answer(order: str, question: str) -> tuple[int, object, object]:
        chars, sent = [], []
        tokenizer, real_open = gen.tokenizer, gen.open

        def encode(text, *args, **kwargs):
            if not sent:
                chars.append(len(text))
            return type(tokenizer).encode(tokenizer, text, *args, **kwargs)

        def opened(*args, **kwargs):
            sent.append(args[0])
            return real_open(*args, **kwargs)

        tokenizer.encode, gen.open = encode, opened
        try:
            result = asyncio.run(engine.generate(query(d, order, question)))
        finally:
            del tokenizer.encode, gen.open
        engine.settle()
        return sum(chars), sent[0], result

    documents = sum(len(t) for t in d.values())
    question = "Which drawer keeps 6 keys?"
    chars, prompt, again = tokenized_before_the_answer("CADB", question)
    assert again.metrics.extra["cold_spans"] == "in-context"
    assert chars < documents / 4, (chars, documents)
    assert prompt == flattened_prompt_ids(engine.tokenizer, query(d, "ABCD", question).input)
    # The check can fail: with nothing kept, the whole prompt is tokenized again before the answer.
    monkeypatch.setattr(gen.prefix_tokens, "enabled", False)
    gen.prefix_tokens.clear()
    chars, prompt, again = tokenized_before_the_answer("DBAC", "Which drawer keeps 1 key?")
    assert again.metrics.extra["cold_spans"] == "in-context" and chars > documents


def test_keep_span_order_reads_each_group_in_the_order_given(engine):
    """By default a group is read in one order per set of documents (`lowering.span_order`);
    `EngineConfig(keep_span_order=True)` (`spanq serve --keep-span-order`) keeps the order given."""
    from itertools import permutations

    from spanq_backend.serving.engine import EngineConfig

    d = docs("order")
    gen = engine.generator
    assert EngineConfig().keep_span_order is False and gen.keep_span_order is False
    orders = ["".join(p) for p in permutations("ABCD")]
    default = {o: engine.lower(query(d, o)).span_texts for o in orders}
    assert len({tuple(texts) for texts in default.values()}) == 1  # one order for the set, whatever was given
    moved = [o for o in orders if default[o] != [d[c] for c in o]]
    assert moved, "no order of these documents moves one: the check could not fail"
    with temporarily(gen, keep_span_order=True):
        assert all(engine.lower(query(d, o)).span_texts == [d[c] for c in o] for o in orders)


def test_the_same_documents_in_another_order_are_read_where_they_sit(engine):
    """A set of documents asked about again, in another order, is laid out as before (one order per set,
    `lowering.span_order`): its blocks sit where the last query moved them, and nothing is relocated. The check
    fails on the order given (`keep_span_order=True`): every reordered document is moved again."""
    from spanq_backend import vllm_integration as vllm_plugin

    def moved_by(d: dict[str, str], orders: list[str]) -> list[int]:
        asyncio.run(engine.prepare(engine.lower(query(d, orders[0]))))  # prepared alone: each at its anchor
        moved = []
        for order in orders:
            before = vllm_plugin.stats()["moved_blocks"]
            out = asyncio.run(engine.generate(query(d, order, question=f"Which drawer? ({order})")))
            assert out.metrics.prepared_spans == 0 and out.metrics.extra["cold_spans"] == "warm"
            moved.append(vllm_plugin.stats()["moved_blocks"] - before)
        return moved

    first, *again = moved_by(docs("sit"), ["ABCD", "DCBA", "BADC", "CADB"])
    assert first > 0 and again == [0, 0, 0], (first, again)  # moved once, into the set's order
    with temporarily(engine.generator, keep_span_order=True):
        first, *again = moved_by(docs("sit-given"), ["ABCD", "DCBA", "BADC", "CADB"])
    assert all(m > 0 for m in again), again  # the broken variant moves them on every query


def test_a_call_waiting_for_deferred_prepares_never_cancels_them_and_never_waits_on_itself(engine, monkeypatch):
    """`_await_pending` waits for a prepare under way without cancelling it (other calls wait for it too, and the
    engine sets its result later); the caller's own cancellation goes through; and while it waits the call is not
    counted as running, so prepares queued for a quiet engine can start."""
    import concurrent.futures
    import time

    from spanq_backend.serving.generator import SpanGenerator

    gen = engine.generator
    monkeypatch.setattr(SpanGenerator, "PENDING_WAIT_S", 0.3)

    def pending(prompt: list[int], running: bool) -> concurrent.futures.Future:
        f: concurrent.futures.Future = concurrent.futures.Future()
        if running:
            assert f.set_running_or_notify_cancel()
        gen._pending[tuple(prompt)] = f
        return f

    def check(await_pending) -> None:
        under_way = pending([901, 902], running=True)
        asyncio.run(await_pending(gen, [[901, 902]]))  # times out
        assert not under_way.cancelled(), "a call that stops waiting cancelled the prepare"
        under_way.set_result(3)  # what the engine does when it finishes

        under_way = pending([903], running=True)

        async def cancelled_while_waiting():
            task = asyncio.ensure_future(await_pending(gen, [[903]]))
            await asyncio.sleep(0.05)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return
            raise AssertionError("the caller's cancellation was swallowed")

        asyncio.run(cancelled_while_waiting())
        assert not under_way.cancelled(), "the caller's cancellation cancelled the prepare"
        under_way.set_result(1)

        # a call that waits is not counted as running: prepares queued for a quiet engine start meanwhile (on
        # `spanq serve` they wait on this loop for no call to run: counted, the call would hold them back)
        queued = pending([904], running=False)
        told: list[int] = []
        kept, gen.on_quiet = gen.on_quiet, (lambda: told.append(gen.calls_running()))
        monkeypatch.setattr(SpanGenerator, "PENDING_WAIT_S", 5.0)

        async def a_call_waiting():
            gen.active_calls += 1  # as `generate` counts its call
            try:
                task = asyncio.ensure_future(await_pending(gen, [[904]]))
                await asyncio.sleep(0.05)
                running, queued_then = gen.calls_running(), list(told)
                queued.set_result(2)  # what the queue does once it may run
                await task
                return running, queued_then
            finally:
                gen.active_calls -= 1

        try:
            started = time.perf_counter()
            running, queued_then = asyncio.run(a_call_waiting())
            assert running == 0 and queued_then == [0], "a waiting call held back the prepares it waits for"
            assert time.perf_counter() - started < 1.0
        finally:
            gen.on_quiet = kept
            monkeypatch.setattr(SpanGenerator, "PENDING_WAIT_S", 0.3)

    try:
        check(SpanGenerator._await_pending)

        # the check can fail: the wait as it was (wait_for over the wrapped futures, every cancellation suppressed)
        async def as_it_was(self, prompts):
            import contextlib

            futures = [f for p in prompts if (f := self._pending.get(tuple(p))) is not None]
            with contextlib.suppress(asyncio.TimeoutError, concurrent.futures.CancelledError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for f in futures),
                                                      return_exceptions=True), self.PENDING_WAIT_S)

        with pytest.raises(AssertionError, match="cancellation was swallowed"):
            check(as_it_was)
    finally:
        for key in [(901, 902), (903,), (904,)]:
            gen._pending.pop(key, None)


def test_a_call_does_not_wait_for_queued_prepares_that_cannot_start_while_other_calls_run(engine, monkeypatch):
    """Deferred prepares start only when no call runs. A call whose documents' prepares are still queued behind
    another call under way computes those documents itself, as its cold policy says, instead of waiting for
    prepares that cannot start (it waited `PENDING_WAIT_S`, 60 s, beside a steady stream of other calls)."""
    from spanq_backend.serving.generator import SpanGenerator

    monkeypatch.setattr(SpanGenerator, "PENDING_WAIT_S", 600.0)
    d = docs("queued")

    async def scenario():
        release = asyncio.Event()
        streaming = asyncio.Event()

        async def held(_piece: str) -> None:  # a call whose reader takes its time: under way until released
            streaming.set()
            await release.wait()

        other = asyncio.ensure_future(engine.generate(query(docs("busy"), "A"), on_token=held))
        await streaming.wait()
        try:
            cold = await engine.generate(query(d, "ABCD"))
            # another instruction: not read in context again, so the subset reads spans, which are not cached yet
            # (their prepares queued behind the held call: it waited for them until the test's bound)
            subset = await asyncio.wait_for(
                engine.generate(query(d, "BA", "Which drawer keeps 2 keys?", instruction="Answer from these cards.")),
                timeout=120)
            return cold.metrics, subset, other.done()
        finally:
            release.set()
            await other

    cold, subset, other_done = asyncio.run(scenario())
    assert cold.deferred_spans == 4 and not other_done
    assert subset.metrics.extra["cold_spans"] == "context" and subset.texts[0] is not None
    assert engine.settle(120)


def test_a_call_does_not_wait_for_a_prepare_between_its_parts_while_other_calls_run(engine, monkeypatch):
    """A long document's deferred prepare goes in parts, each started when no call runs. One that has begun (its
    first part computed) waits for its next part while other calls run: a call that needs that document does not
    wait for it then either (it waited the full `PENDING_WAIT_S` for a prepare "under way")."""
    from spanq_backend.serving.generator import SpanGenerator

    monkeypatch.setattr(SpanGenerator, "PENDING_WAIT_S", 600.0)
    long_doc = "Ledger. " + " ".join(f"Drawer L{i} keeps {i * 3 % 7} keys." for i in range(150))
    d = {"A": long_doc}
    assert len(engine.tokenizer.encode(long_doc)) > 3 * type(engine).IDLE_BATCH_TOKENS - 200  # three parts or more

    async def scenario():
        cold = await engine.generate(query(d, "A"))
        pending = engine.generator._pending.get(tuple(engine.lower(query(d, "A")).prepare_prompt(0)))
        assert pending is not None, "the document's prepare was not deferred"
        deadline = asyncio.get_running_loop().time() + 60
        while not (pending.running() or pending.done()):  # nothing runs: its first part starts
            assert asyncio.get_running_loop().time() < deadline, "the deferred prepare never started"
            await asyncio.sleep(0.002)
        release, streaming = asyncio.Event(), asyncio.Event()

        async def held(_piece: str) -> None:
            streaming.set()
            await release.wait()

        other = asyncio.ensure_future(engine.generate(query(docs("busy2"), "A"), on_token=held))
        await streaming.wait()
        try:
            again = await asyncio.wait_for(
                engine.generate(query(d, "A", "Which drawer keeps 2 keys?", instruction="Answer from these cards.")),
                timeout=120)
            return cold.metrics, pending.done(), again
        finally:
            release.set()
            await other

    cold, finished_first, again = asyncio.run(scenario())
    assert cold.deferred_spans == 1
    assert not finished_first, "the prepare ended before the other call began: nothing was checked"
    assert again.metrics.extra["cold_spans"] == "context" and again.texts[0] is not None
    assert engine.settle(120)


def test_documents_compiled_on_an_engine_without_a_tier_are_read_from_its_cache_by_the_first_query(engine):
    """`SpanEngine.compile` (what `spanq prepare` runs) on an engine with no span tier puts the documents' spans in
    its cache: the first query over them reads them there, and `GET /v1/spans` reports them to a router. The
    compiled spans were unknown to the engine's record of spans it had prepared, so the first query over them was
    laid out as new documents and read them in context (0 tokens from the cache), and no router heard of them."""
    from spanq_backend.serving.lowering import span_digest

    d = docs("compiled")
    report = asyncio.run(engine.compile(list(d.values())))
    assert report["prepared"] == 4
    assert {span_digest(t) for t in d.values()} <= set(engine.generator.cached_span_digests())
    first = asyncio.run(engine.generate(query(d, "CADB", "Which drawer keeps 4 keys?"))).metrics
    lowered = engine.lower(query(d, "CADB", "Which drawer keeps 4 keys?"))
    assert first.extra["cold_spans"] == "warm" and first.prepared_spans == 0 and first.deferred_spans == 0
    assert first.cached_tokens >= sum(e - s for s, e in lowered.table.spans)


def test_compile_refuses_a_string_where_a_list_of_documents_goes(engine):
    """`engine.compile("a text")` compiled each character as a document of its own (and wrote them to the tier,
    for good); a list holding something else than a text failed in the tokenizer. Both are named, nothing computed."""
    from spanq_integrations.query.errors import QueryValidationError

    before = engine.generator.cached_span_digests()
    with pytest.raises(QueryValidationError, match=r"documents: expected a list of document texts, got str"):
        asyncio.run(engine.compile("just a string"))
    with pytest.raises(QueryValidationError, match=r"documents\[1\]: expected a document's text, got int"):
        asyncio.run(engine.compile(["a text", 7]))
    assert engine.generator.cached_span_digests() == before, "nothing was prepared"


def test_a_deferred_prepare_cancelled_before_it_starts_leaves_the_engine_serving(engine):
    """A deferred prepare whose future was cancelled while it waited in the engine's queue is skipped: set later,
    that future would raise in the engine's thread and take every request down with it."""
    import concurrent.futures

    d = docs("skip")
    prompt = engine.lower(query(d, "AB")).prepare_prompt(0) + [engine.generator.pad_token_id]
    gone: concurrent.futures.Future = concurrent.futures.Future()
    gone.cancel()
    engine.run_when_idle([(prompt, gone)])
    assert engine.settle(60)
    done = asyncio.run(engine.generate(query(d, "BA")))
    assert done.texts and done.texts[0] is not None


def test_deferred_prepares_wait_for_the_calls_under_way_between_their_rounds_too(engine):
    """Deferred prepares start when no call runs, not whenever the engine has no request: a call between its
    prepare round and its answer would otherwise find them in its answer's steps."""
    d = docs("rounds")
    backlog = [engine.lower(query(docs(f"backlog{i}"), "A")).prepare_prompt(0) + [engine.generator.pad_token_id]
               for i in range(3)]
    started_with: list[int] = []
    start_idle = type(engine)._start_idle

    def recording(self, eng):
        if self._idle:
            started_with.append(self._calls_running())
        return start_idle(self, eng)

    async def scenario():
        call = asyncio.ensure_future(engine.generate(query(d, "CDAB").model_copy(update={"cold_spans": "isolate"})))
        await asyncio.sleep(0)  # the call is under way
        engine.run_when_idle([(p, concurrent.futures.Future()) for p in backlog])
        return await call

    import concurrent.futures
    from unittest.mock import patch

    with patch.object(type(engine), "_start_idle", recording):
        done = asyncio.run(scenario())
        assert engine.settle(60)
    assert done.metrics.prepared_spans == 4 and done.texts[0]
    assert started_with and all(n == 0 for n in started_with), f"deferred prepares started beside a call: {started_with}"


def test_a_long_deferred_prompt_is_computed_in_parts_a_call_arriving_meanwhile_waits_at_most_one_for(engine):
    """A deferred prompt past `IDLE_BATCH_TOKENS` tokens (a stock prompt over a set read in context again when
    idle) goes to the engine in parts of whole blocks, each on the blocks the last one cached: a call that arrives
    meanwhile waits for one part, not for the whole prompt. Its future counts every part's tokens."""
    import concurrent.futures
    from unittest.mock import patch

    text = " ".join([*docs("parts").values(), *docs("parts, again").values()])
    ids = engine.tokenizer.encode(text, add_special_tokens=False)  # a plain prompt of ~1.2k new tokens
    limit = type(engine).IDLE_BATCH_TOKENS
    assert len(ids) > 2 * limit
    parts: list[int] = []
    deliver = type(engine)._deliver

    def recording(self, eng, out):
        if out.request_id.startswith("spanq-idle-") and out.finished:
            parts.append(len(out.prompt_token_ids) - 1 - (out.num_cached_tokens or 0))
        return deliver(self, eng, out)

    done: concurrent.futures.Future = concurrent.futures.Future()
    with patch.object(type(engine), "_deliver", recording):
        engine.run_when_idle([(ids, done)])
        assert engine.settle(120)
    assert len(parts) >= 2 and all(0 < n <= limit for n in parts), parts
    assert done.result() == sum(parts)
    assert engine._probe.cached_blocks(ids[:-1]) == (len(ids) - 1) // 32, "every whole block is cached"
