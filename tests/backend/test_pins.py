"""A pinned corpus (`SpanEngine.compile(texts, pin=True)`) stays in the engine's KV cache whatever else runs,
until `unpin`; at most half the cache is pinned, and the engine still answers with the rest."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from spanq_backend.serving.engine import SpanEngine
from spanq_integrations import cross, fragment, generate, plus, user

pytestmark = pytest.mark.vllm

WORDS = ["harbor", "mill", "bridge", "lantern", "orchard", "tower", "quarry", "ferry"]


def doc(tag: str) -> str:
    return f"Record {tag}. " + " ".join(f"The {w} of {tag} was built in year {i}." for i, w in enumerate(WORDS * 2))


def prepare_prompt(engine: SpanEngine, text: str) -> list[int]:
    """The `[anchor][span]` prompt `compile` puts in the cache for `text`."""
    return engine.lower(generate(cross(plus(fragment(text)), user("?")))).prepare_prompt(0)


def cached(engine: SpanEngine, texts: list[str]) -> list[bool]:
    return [engine._probe.cached(prepare_prompt(engine, t)) for t in texts]


@pytest.fixture(scope="module")
def small_engine(tiny_model: Path):
    # 64 blocks of 32 tokens: a few documents' spans fill it, so anything not pinned is evicted by the next ones
    eng = SpanEngine(model=str(tiny_model), block_size=32, max_model_len=1024, max_num_seqs=4, num_blocks=64,
                     cold_spans="isolate")  # fmt: skip
    yield eng
    eng.close()


def test_a_pinned_corpus_stays_cached_while_other_documents_cycle_through_the_cache(small_engine):
    engine = small_engine
    corpus, control = [doc(f"pinned {i}") for i in range(2)], [doc(f"control {i}") for i in range(2)]
    report = asyncio.run(engine.compile(corpus, pin=True))
    assert report["pinned_blocks"] > 0 and report["pin_refused"] == report["pin_missing"] == 0, report
    asyncio.run(engine.compile(control))  # compiled the same way, not pinned
    assert cached(engine, corpus) == [True, True] and cached(engine, control) == [True, True]
    others = [doc(f"other {i}") for i in range(12)]  # several times the cache's 64 blocks
    asyncio.run(engine.compile(others))
    assert cached(engine, corpus) == [True, True], "a pinned document was evicted"
    assert cached(engine, control) == [False, False], "the cache was not under pressure: the test shows nothing"
    # a query over the pinned corpus reads it from the cache: nothing prepared
    call = generate(cross(plus(*[fragment(t) for t in corpus]), user("When was the mill built?")), max_tokens=4,
                    temperature=0)  # fmt: skip
    result = asyncio.run(engine.generator.generate(call))
    assert result.metrics.prepared_spans == 0 and result.metrics.cached_tokens > 0, result.metrics
    # unpinned, the corpus is evicted as any other
    assert engine.unpin() == report["pinned_blocks"] and engine.pinned_blocks == 0
    asyncio.run(engine.compile([doc(f"after {i}") for i in range(12)]))
    assert cached(engine, corpus) == [False, False]


def test_an_app_pins_its_corpus_through_its_backend_from_inside_an_event_loop(small_engine):
    """`EmbeddedBackend.pin` (sync, callable where an event loop runs: a notebook, an async app) pins as
    `compile(pin=True)` does; `unpin` drops them."""
    from spanq_backend.serving.embedded import EmbeddedBackend

    backend = EmbeddedBackend(engine=small_engine)
    corpus = [doc(f"app {i}") for i in range(2)]

    async def inside_a_loop() -> dict:
        return backend.pin(corpus)

    report = asyncio.run(inside_a_loop())
    assert report["pinned_blocks"] > 0 and small_engine.pinned_blocks == report["pinned_blocks"]
    asyncio.run(small_engine.compile([doc(f"churn {i}") for i in range(12)]))
    assert cached(small_engine, corpus) == [True, True]
    assert backend.unpin() == report["pinned_blocks"] and small_engine.pinned_blocks == 0


def test_at_most_half_the_cache_is_pinned_and_the_engine_still_answers(small_engine):
    engine = small_engine
    corpus = [doc(f"large {i}") for i in range(10)]  # more than half of the 64 blocks
    report = asyncio.run(engine.compile(corpus, pin=True))
    try:
        assert report["pin_refused"] > 0 and engine.pinned_blocks == 32, report
        call = generate(cross(plus(fragment(doc("new 1")), fragment(doc("new 2"))), user("Which mill?")), max_tokens=4,
                        temperature=0)  # fmt: skip
        result = asyncio.run(engine.generator.generate(call))
        assert result.metrics.generated_tokens > 0
        assert engine.reset_prefix_cache(), "a reset drops the pins first (vLLM refuses one with blocks referenced)"
        assert engine.pinned_blocks == 0
    finally:
        engine.unpin()


def test_a_document_that_is_not_unicode_text_is_named_before_anything_is_compiled(small_engine):
    from spanq_integrations.query.errors import QueryValidationError

    with pytest.raises(QueryValidationError, match=r"documents\[1\]: not valid Unicode text"):
        asyncio.run(small_engine.compile([doc("fine"), "half \ud800 a pair"]))
