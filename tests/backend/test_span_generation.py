"""spanq_backend.serving.generator: span-aware generation over a scripted engine stream."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from spanq_backend.kv.span_table import EXTRA_ARGS_KEY
from spanq_backend.serving.generator import SpanGenerator, load_chat_tokenizer
from spanq_integrations import ContextLengthError, cross, fragment, generate, plus, system, user

# --------------------------------------------------------------------------------------------- generation


class ScriptedEngine:
    """A `RequestStream` that answers every request with `pieces` (one delta each) and records the requests."""

    def __init__(self, pieces=("Hel", "lo"), cached=0):
        self.pieces = pieces
        self.cached = cached
        self.requests = []
        self.closed = 0

    async def __call__(self, prompt_ids, params):
        self.requests.append(SimpleNamespace(prompt_ids=list(prompt_ids), params=params))
        pieces = self.pieces[: params.max_tokens]
        try:
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                choice = SimpleNamespace(text=piece, token_ids=[7], finish_reason="length" if last else None)
                yield SimpleNamespace(outputs=[choice], num_cached_tokens=self.cached, finished=last)
                await asyncio.sleep(0)
        finally:
            self.closed += 1


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_chat_tokenizer(tiny_model)


def span_generator(engine, tokenizer, **kw):
    return SpanGenerator(engine, tokenizer, block_size=32, max_model_len=4096, model_name="tiny", **kw)


def rag(order="AB", **kw):
    docs = {"A": "Alpha is first. " * 10, "B": "Beta is second. " * 10}
    return generate(
        cross(system("Use the notes."), plus(*[fragment(docs[c]) for c in order]), user("Go")), **kw
    )


def test_generate_prepares_each_span_then_runs_the_request_with_its_span_table(tokenizer):
    pytest.importorskip("vllm")
    engine = ScriptedEngine()
    gen = span_generator(engine, tokenizer)
    streamed = []
    completion = asyncio.run(
        gen.generate(rag(max_tokens=2, temperature=0.0), path="$.x", on_token=streamed.append)
    )

    lowered = gen.lower(rag(max_tokens=2))
    *prepares, main = engine.requests
    assert len(prepares) == 3  # two spans under the template anchor, and the prompt's own prefix beside them
    anchor = lowered.table.anchor_len
    # `[anchor][span]` and one pad token, so a cached span costs one token to prepare, not a block.
    assert sorted(tuple(p.prompt_ids) for p in prepares) == sorted(
        [tuple(lowered.prepare_prompt(i) + [gen.pad_token_id]) for i in range(2)]
        + [tuple(lowered.prefix_prompt() + [gen.pad_token_id])]
    )
    assert all(p.params.max_tokens == 1 and p.params.temperature == 0 for p in prepares)
    assert main.prompt_ids == lowered.token_ids
    assert main.params.extra_args[EXTRA_ARGS_KEY] == lowered.table.to_extra_args()
    assert anchor > 0

    assert completion.texts == ["Hello"] and streamed == ["Hel", "lo"]
    assert completion.finish_reasons == ["length"]
    m = completion.metrics
    assert (m.path, m.model, m.prompt_tokens, m.generated_tokens) == (
        "$.x",
        "tiny",
        len(lowered.token_ids),
        2,
    )
    assert m.prepared_spans == 2 and m.padded_tokens == lowered.padded_tokens and m.ttft_s is not None


def test_spans_already_cached_are_not_counted_as_prepared(tokenizer):
    pytest.importorskip("vllm")
    gen = span_generator(ScriptedEngine(cached=4096), tokenizer)
    completion = asyncio.run(gen.generate(rag(max_tokens=1)))
    assert completion.metrics.prepared_spans == 0
    assert completion.metrics.cached_tokens == 4096


def test_tokens_the_calls_own_prepares_computed_are_not_counted_as_cached(tokenizer):
    """The engine says the request found 300 tokens cached; 2 prepares of this call computed 2 x 96 of them
    moments earlier: 108 existed before the call (invariant 8)."""
    pytest.importorskip("vllm")

    class Engine(ScriptedEngine):
        async def __call__(self, prompt_ids, params):
            prepare = params.max_tokens == 1
            self.cached = len(prompt_ids) - 1 - 96 if prepare else 300
            async for out in super().__call__(prompt_ids, params):
                yield out

    generator = span_generator(Engine(), tokenizer, default_anchor="prefix")  # no separate prefix request
    completion = asyncio.run(generator.generate(rag(max_tokens=2)))
    assert completion.metrics.prepared_spans == 2 and completion.metrics.prepared_tokens == 192
    assert completion.metrics.cached_tokens == 300 - 192


def test_n_choices_run_as_separate_requests_with_their_own_seeds(tokenizer):
    pytest.importorskip("vllm")
    engine = ScriptedEngine()
    gen = span_generator(engine, tokenizer)
    completion = asyncio.run(gen.generate(generate(user("Hi"), max_tokens=2, n=3, seed=10)))
    assert completion.texts == ["Hello"] * 3 and completion.metrics.generated_tokens == 6
    assert sorted(r.params.seed for r in engine.requests) == [10, 11, 12]


def test_a_failing_consumer_closes_the_engine_stream(tokenizer):
    pytest.importorskip("vllm")
    engine = ScriptedEngine(pieces=("a", "b", "c"))
    gen = span_generator(engine, tokenizer)

    def explode(piece):
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError):
        asyncio.run(gen.generate(generate(user("Hi"), max_tokens=3), on_token=explode))
    assert engine.closed == len(engine.requests) == 1, (
        "the stream was closed, so the engine aborts the request"
    )


def test_an_over_long_prompt_is_refused_before_the_engine_sees_it(tokenizer):
    engine = ScriptedEngine()
    gen = SpanGenerator(engine, tokenizer, block_size=32, max_model_len=64, model_name="tiny")
    with pytest.raises(ContextLengthError):
        asyncio.run(gen.generate(generate(user("word " * 200), max_tokens=2)))
    assert engine.requests == []


def test_a_generated_span_the_engine_knows_is_prepared_on_its_own_anchor(tokenizer):
    pytest.importorskip("vllm")
    from spanq_integrations import Assistant

    inner = generate(user("Describe the key."), max_tokens=4)
    answer = Assistant(text="A brass key.", source=inner)
    whole = tokenizer.encode(
        "<|im_start|>user\nDescribe the key.<|im_end|>\nA brass key.", add_special_tokens=False
    )
    engine = ScriptedEngine()
    gen = span_generator(engine, tokenizer, generated_ids=lambda a: whole if a == answer else None,
                         default_anchor="prefix")
    query = generate(
        cross(system("Pick one."), plus(answer, fragment("A copper lamp.")), user("Which?")), max_tokens=1
    )
    asyncio.run(gen.generate(query))

    lowered = gen.lower(query)
    assert lowered.table.anchors is not None and 0 in lowered.table.anchors
    *prepares, _ = engine.requests
    assert len(prepares) == 2
    alone = [p for p in prepares if p.prompt_ids[: len(whole)] == whole]
    assert len(alone) == 1  # the generated span: its own tokens from position 0, its inner prompt first
    shared = lowered.token_ids[: lowered.table.anchor_len]
    (other,) = [p for p in prepares if p is not alone[0]]
    assert other.prompt_ids[: len(shared)] == shared  # the fragment: after the shared prefix
