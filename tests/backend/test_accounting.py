"""Honest accounting (invariant 8 of docs/design.md): `cached_tokens` counts only prompt tokens whose KV
existed before the call; what the call's own prepare requests computed is `prepared_tokens`, never cached."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from spanq_backend.serving.lowering import span_digest
from spanq_integrations import cross, fragment, generate, plus, system, user

pytestmark = [pytest.mark.vllm]


def rag(tag: str, order: str):
    docs = {c: f"Sheet {c}{tag}. " + " ".join(f"Row {i} of {c} says {i * 3 % 11}." for i in range(18)) for c in "ABCD"}
    return generate(
        cross(system(f"Answer from the sheets ({tag})."), plus(*[fragment(docs[c]) for c in order]), user("Which row?")),
        max_tokens=2,
        temperature=0.0,
    )


@pytest.fixture(params=["isolate", "context"])
def cold_spans(request, tiny_backend):
    """The shared engine under each way of computing cold spans (restored after the test)."""
    generator = tiny_backend.engine.generator
    kept, generator.cold_spans = generator.cold_spans, request.param
    yield request.param
    generator.cold_spans = kept


def test_a_cold_call_reads_nothing_from_the_cache_and_a_warm_one_reads_its_documents(tiny_backend, cold_spans):
    engine = tiny_backend.engine
    tag = uuid.uuid4().hex[:8]  # a system prompt and documents no earlier call has seen

    async def scenario():
        cold = await engine.generate(rag(tag, "ABCD"))
        engine.settle()  # "context": the documents are prepared alone once the engine is idle
        return cold, await engine.generate(rag(tag, "DBCA"))

    cold, warm = (c.metrics for c in asyncio.run(scenario()))
    lowered = engine.lower(rag(tag, "DBCA"))
    span_tokens = sum(e - s for s, e in lowered.table.spans)
    if cold_spans == "isolate":  # prepared alone before the answer: its own prepare requests' tokens
        assert cold.prepared_spans == 4 and cold.prepared_tokens >= span_tokens
    else:  # computed in context by the answer, as any prompt token: neither prepared nor cached
        assert cold.prepared_spans == 0 and cold.prepared_tokens == 0 and cold.deferred_spans == 4
    assert cold.cached_tokens == 0, f"a cold call reported {cold.cached_tokens} tokens as read from the cache"
    # ("context": the cold call's stock prompt left the span layout's padded prefix to the deferred prepares)
    assert warm.prepared_spans == 0 and warm.prepared_tokens == 0
    assert warm.cached_tokens >= span_tokens, "the warm call read every document from the cache"
    for m in (cold, warm):
        assert 0 <= m.cached_tokens <= m.prompt_tokens  # prompt = cached + computed


def test_span_counters_are_readable_in_process_and_agree_with_the_calls(tiny_backend):
    from prometheus_client import REGISTRY

    from spanq_backend.serving import metrics

    engine = tiny_backend.engine
    tag = uuid.uuid4().hex[:8]
    before = metrics.snapshot()
    kept, engine.generator.cold_spans = engine.generator.cold_spans, "isolate"  # prepared by the call itself

    async def scenario():
        try:
            return await engine.generate(rag(tag, "ABCD")), await engine.generate(rag(tag, "DBCA"))
        finally:
            engine.generator.cold_spans = kept  # the session's engine: leave it as found

    cold, warm = (c.metrics for c in asyncio.run(scenario()))
    after = metrics.snapshot()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta["span_calls"] == 2 and delta["spans_prepared"] == cold.prepared_spans == 4
    assert delta["spans_hit"] == 4 and delta["prepared_tokens"] == cold.prepared_tokens
    assert delta["padding_tokens"] == cold.padded_tokens + warm.padded_tokens
    assert delta["blocks_relocated"] > 0 and delta["relocation_seconds"] > 0  # DBCA read moved keys
    # the same numbers in the Prometheus registry vLLM serves
    assert REGISTRY.get_sample_value("spanq_spans_prepared_total") == after["spans_prepared"]
    assert REGISTRY.get_sample_value("spanq_blocks_relocated_total") == after["blocks_relocated"]


def test_a_span_prepared_after_an_anchor_the_prompt_does_not_hold_leaves_the_cached_count_whole(tiny_backend):
    """A call reads three documents from the cache and prepares a fourth after another anchor (the "system" one:
    the query's system message and the lead-in, not the prompt's own prefix). The answer reads the prefix and the
    three documents from the cache: all counted as cached. Until 2026-12-02 the prepare's every token was taken
    off the cached count, the anchor's included, which the answer never reads: the three documents were
    under-counted by the anchor's length."""
    engine = tiny_backend.engine
    tag = uuid.uuid4().hex[:8]
    docs = [f"Sheet {c}{tag}. " + " ".join(f"Row {i} of {c} says {i * 7 % 13}." for i in range(18)) for c in "ABCD"]

    def query(*groups):
        return generate(cross(system(f"Answer from the sheets ({tag})."), *groups, user("Which row?")),
                        max_tokens=2, temperature=0.0)

    three = plus(*[fragment(d) for d in docs[:3]])
    both = query(three, plus(fragment(docs[3]), anchor="system"))
    kept, engine.generator.cold_spans = engine.generator.cold_spans, "isolate"  # the call prepares the fourth itself

    async def scenario():
        try:
            await engine.generate(query(three))
            return await engine.generate(both)
        finally:
            engine.generator.cold_spans = kept  # the session's engine: leave it as found

    call = asyncio.run(scenario()).metrics
    lowered = engine.lower(both)
    spans = lowered.table.spans
    assert len(spans) == 4 and not isinstance(lowered.table.anchor_of(3), int), "the fourth is anchored elsewhere"
    assert call.prepared_spans == 1 and call.prepared_tokens >= lowered.table.anchor_size(3)
    read = lowered.table.anchor_len + sum(e - s for s, e in spans[:3])
    assert call.cached_tokens >= read, f"{call.cached_tokens} cached; the prefix and three documents are {read}"
    assert call.cached_tokens <= call.prompt_tokens - (spans[3][1] - spans[3][0]), "the prepared one is not cached"


def test_the_spans_remembered_for_the_router_are_bounded_by_their_block_hashes(tiny_backend, monkeypatch):
    """What `GET /v1/spans` reports (the spans a replica's cache holds, for the cluster's router) is remembered per
    span with its prepare prompt's block hashes; over many documents that record stays within REMEMBERED_BLOCKS
    hashes (it held 65,536 spans whatever their size: ~180 MB for 1k-token documents), the least recently used
    forgotten first, and the recent ones still reported."""
    engine = tiny_backend.engine
    gen = engine.generator
    tag = uuid.uuid4().hex[:8]
    docs = [f"Ledger {i}{tag}. " + " ".join(f"Entry {j} of {i} reads {j * 7 % 13}." for j in range(12)) for i in range(6)]

    def ask(*texts):
        return generate(cross(system(f"Answer ({tag})."), plus(*[fragment(t) for t in texts]), user("Which entry?")),
                        max_tokens=1, temperature=0.0, cold_spans="isolate")

    asyncio.run(engine.generate(ask(docs[0])))
    per_span = len(gen._span_blocks[span_digest(docs[0])])
    monkeypatch.setattr(gen, "REMEMBERED_BLOCKS", 3 * per_span + per_span // 2, raising=False)  # three of these
    for i in range(1, 6):
        asyncio.run(engine.generate(ask(docs[i])))
    remembered = {span_digest(d) for d in docs} & set(gen._span_blocks)
    assert remembered == {span_digest(d) for d in docs[3:]}, "not the three most recent documents"
    assert remembered <= set(gen.cached_span_digests())
    assert gen._remembered_blocks == sum(len(h or ()) for h in gen._span_blocks.values()) <= gen.REMEMBERED_BLOCKS
