"""spanq_backend.serving.generator: span-aware generation over a scripted engine stream."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest

from spanq_backend.kv.span_table import EXTRA_ARGS_KEY
from spanq_backend.serving.generator import SpanGenerator, load_chat_tokenizer
from spanq_integrations import ContextLengthError, cross, fragment, generate, plus, system, user

# --------------------------------------------------------------------------------------------- generation


class ScriptedEngine:
    """A `RequestStream` that answers every request with `pieces` (one delta each) and records the requests."""

    def __init__(self, pieces=("Hel", "lo"), cached=0, ids=None):
        self.pieces = pieces
        self.ids = ids or [7] * len(pieces)  # each piece's token id
        self.cached = cached
        self.requests = []
        self.closed = 0

    async def __call__(self, prompt_ids, params):
        self.requests.append(SimpleNamespace(prompt_ids=list(prompt_ids), params=params))
        pieces = self.pieces[: params.max_tokens]
        try:
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                choice = SimpleNamespace(text=piece, token_ids=[self.ids[i]], finish_reason="length" if last else None)
                yield SimpleNamespace(outputs=[choice], num_cached_tokens=self.cached, finished=last)
                await asyncio.sleep(0)
        finally:
            self.closed += 1


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_chat_tokenizer(tiny_model)


def span_generator(engine, tokenizer, **kw):
    """A generator on the scripted engine. Nothing recomputed unless a test says (these count prepares and cached
    tokens; recompute's own requests are `tests/backend/test_recompute.py`'s): the default, "first+question",
    recomputes each span's first block, "question" recomputed nothing in these prompts."""
    kw.setdefault("default_recompute", 0)
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
    """The engine says the request found 300 tokens cached; 2 prepares of this call computed 2 x 96 tokens
    moments earlier (invariant 8). The answer reads 160 of them from the cache: A's 64 and B's 32 span tokens and
    the 32-token prefix each prepare computed (counted twice: the count errs low, never high); not B's padded
    tail block (32), which the answer computes as context. 140 existed before the call."""
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
    lowered = generator.lower(rag(max_tokens=2))
    assert lowered.table.spans == ((32, 96), (96, 128)) and len(lowered.prepare_tails[1]) == 32  # as said above
    assert completion.metrics.cached_tokens == 300 - (64 + 32) - (32 + 32)


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


def test_a_generated_span_the_engine_knows_is_its_output_on_its_own_prompt(tokenizer):
    pytest.importorskip("vllm")
    from spanq_backend.serving.lowering import GeneratedSpan
    from spanq_integrations import Assistant

    inner = generate(user("Describe the key."), max_tokens=4)
    answer = Assistant(text="A brass key.", source=inner)
    prompt = tuple(tokenizer.encode("<|im_start|>user\nDescribe the key.<|im_end|>\n<|im_start|>assistant\n"))
    prompt += (tokenizer.encode("\n")[-1],) * ((-len(prompt)) % 32)
    known = GeneratedSpan(prompt, tuple(tokenizer.encode("A brass key.", add_special_tokens=False)))
    engine = ScriptedEngine()
    gen = span_generator(engine, tokenizer, generated_ids=lambda a: known if a == answer else None,
                         default_anchor="prefix")
    query = generate(
        cross(system("Pick one."), plus(answer, fragment("A copper lamp.")), user("Which?")), max_tokens=1
    )
    completion = asyncio.run(gen.generate(query))

    lowered = gen.lower(query)
    assert lowered.table.anchors is not None and lowered.table.anchors[0] == prompt
    assert completion.metrics.extra["generated_spans"] == 1
    s, e = lowered.table.spans[0]
    assert lowered.token_ids[s : s + len(known.output_ids)] == list(known.output_ids), "the output alone"
    *prepares, _ = engine.requests
    alone = [p for p in prepares if p.prompt_ids[: len(prompt)] == list(prompt)]
    assert len(alone) == 1  # the generated span: after its own prompt
    assert alone[0].prompt_ids[len(prompt) : len(prompt) + e - s] == lowered.token_ids[s:e]
    shared = lowered.token_ids[: lowered.table.anchor_len]
    assert any(p.prompt_ids[: len(shared)] == shared for p in prepares if p is not alone[0])


def test_a_generated_answer_the_engine_does_not_know_is_read_as_text_and_said_so(tokenizer):
    pytest.importorskip("vllm")
    from spanq_integrations import Assistant

    answer = Assistant(text="A brass key.", source=generate(user("Describe the key."), max_tokens=4))
    gen = span_generator(ScriptedEngine(), tokenizer)
    query = generate(cross(plus(answer, fragment("A copper lamp.")), user("Which?")), max_tokens=1)
    completion = asyncio.run(gen.generate(query))
    assert completion.metrics.extra["generated_spans"] == 0
    assert completion.metrics.extra["generated_as_text"] == 1
    lowered = gen.lower(query)
    s, _ = lowered.table.spans[0]
    text_ids = tokenizer.encode("A brass key.", add_special_tokens=False)
    assert lowered.token_ids[s : s + len(text_ids)] == text_ids


def test_an_inner_generation_read_as_a_span_starts_its_output_on_a_block_and_is_sealed(tokenizer):
    pytest.importorskip("vllm")
    ids = tokenizer.encode(" A brass key", add_special_tokens=False)
    engine = ScriptedEngine(pieces=[tokenizer.decode([t]) for t in ids], ids=ids)
    gen = span_generator(engine, tokenizer)
    inner = generate(user("Describe the key."), max_tokens=len(ids))
    plain = gen.lower(inner)
    completion = asyncio.run(gen.generate(inner, span_output=True))
    run, seal = engine.requests
    assert len(run.prompt_ids) % 32 == 0 and len(plain.token_ids) % 32 != 0
    assert completion.metrics.padded_tokens == len(run.prompt_ids) - len(plain.token_ids)
    # The pads are newlines at the end of the user's message, before the template closes it.
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n")
    newline = tokenizer.encode("\n")[-1]
    assert run.prompt_ids[-len(tail) :] == plain.token_ids[-len(tail) :] == tail
    assert run.prompt_ids[len(plain.token_ids) - len(tail) : -len(tail)] == [newline] * completion.metrics.padded_tokens
    assert seal.prompt_ids[: len(run.prompt_ids)] == run.prompt_ids, "the seal continues the generation"
    assert completion.metrics.extra["sealed_outputs"] == 1
    # Without span_output, the prompt is the template's own.
    asyncio.run(gen.generate(inner))
    assert engine.requests[-1].prompt_ids == plain.token_ids


def test_a_stock_engine_flattens_without_padding_so_a_prompt_that_fits_runs(tokenizer):
    """Thirty short fragments: their span layout (a padded block each) would not fit a 256-token window, the
    flattened prompt does; a stock engine sends the flattened prompt."""
    pytest.importorskip("vllm")
    query = generate(cross(plus(*[fragment(f"Note {i}.") for i in range(30)]), user("Go")), max_tokens=2)
    spans_gen = span_generator(ScriptedEngine(), tokenizer)
    assert spans_gen.lower(query).padded_tokens > 0 and len(spans_gen.lower(query).token_ids) > 256
    engine = ScriptedEngine()
    gen = SpanGenerator(engine, tokenizer, block_size=32, max_model_len=256, model_name="tiny", spans=False)
    asyncio.run(gen.generate(query))
    (request,) = engine.requests
    assert len(request.prompt_ids) < 256 and EXTRA_ARGS_KEY not in (request.params.extra_args or {})
    with pytest.raises(ContextLengthError):  # and one that does not fit is still refused before the engine
        asyncio.run(gen.generate(generate(cross(plus(*["word " * 300]), user("Go")), max_tokens=2)))
    assert len(engine.requests) == 1


def test_a_chat_template_that_refuses_the_messages_is_the_querys_error(tiny_model):
    import copy

    from spanq_backend.serving.lowering import lower
    from spanq_integrations import QueryValidationError

    strict = copy.deepcopy(load_chat_tokenizer(tiny_model))
    strict.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    with pytest.raises(QueryValidationError, match="chat template refused these messages.*system, user"):
        lower(cross(system("Be brief."), user("Hi")).model_copy(), strict, 32, 198)
    assert lower(user("Hi"), strict, 32, 198).token_ids  # what the template takes still renders


def test_deferred_prepares_where_the_generator_runs_them_go_in_parts_and_a_call_comes_between(tokenizer):
    """On `spanq serve` the generator runs deferred prepares itself, once no call runs: at most `IDLE_BATCH_TOKENS`
    tokens at a time, however many calls deferred them (a call that arrives meanwhile waits for one part, not the
    whole backlog), a longer prompt in parts of whole blocks, each a prefix of it (what the last part cached is read,
    not computed), its future set to every part's tokens when the last is done. (The whole backlog went to the
    engine as one batch; then each call's deferred prepares as a batch of their own, all at once.)"""
    pytest.importorskip("vllm")
    engine = ScriptedEngine(pieces=("x",))
    gen = span_generator(engine, tokenizer)
    limit, bs = getattr(gen, "IDLE_BATCH_TOKENS", 512), gen.block_size
    long = [(i % 500) + 10 for i in range(40 * bs)]  # 1280 tokens: a stock prompt read in context again, say
    short = [7] * (3 * bs)

    async def scenario():
        gen.defer([short])  # two calls' deferred prepares: the bound is the server's, not each call's
        gen.defer([], also=[long])
        futures = [gen._pending[tuple(short)], gen._pending[tuple(long)]]
        while len(engine.requests) < 1:  # the first batch is under way
            await asyncio.sleep(0)
        answer = await gen.generate(generate(user("Hello"), max_tokens=1))  # a call arriving meanwhile
        for f in futures:
            await asyncio.wrap_future(f)
        return answer, [f.result() for f in futures]

    answer, (short_tokens, long_tokens) = asyncio.run(scenario())
    prompts = [r.prompt_ids[:-1] for r in engine.requests]  # each request's prompt, less the token past it
    prepares = [p for p in prompts if p == short or p == long[: len(p)]]
    assert answer.texts == ["x"]
    assert len(prepares) == len(prompts) - 1 >= 3, "the backlog went as one batch"
    parts = [len(p) for p in prepares if p != short]
    assert parts == sorted(parts) and parts[-1] == len(long), "not parts of the long prompt, each further on"
    assert all(n % bs == 0 for n in parts)  # whole blocks: each part's last block is cached for the next
    # each batch computes at most `limit` new tokens: the short prompt and the first part, then one part each
    assert len(short) + parts[0] <= limit and all(b - a <= limit for a, b in itertools.pairwise(parts)), parts
    # the call ran between the parts (after the first batch), not after the whole backlog
    call_at = next(i for i, p in enumerate(prompts) if p not in prepares)
    assert 0 < call_at < len(prompts) - 1
    assert short_tokens == len(short) and long_tokens == sum(parts)  # this engine caches nothing: every part computes all


def test_a_batch_of_deferred_prepares_never_holds_two_parts_of_one_prompt(tokenizer):
    """After a prompt that ends inside a block, what is left of a batch's budget is whole blocks: the next prompt's
    part takes all of it, and the next batch goes on from there (a remainder under a block took a second part of the
    same prompt into the batch, computing a block again beside the first)."""
    pytest.importorskip("vllm")
    engine = ScriptedEngine(pieces=("x",))
    gen = span_generator(engine, tokenizer)
    limit, bs = getattr(gen, "IDLE_BATCH_TOKENS", 512), gen.block_size
    odd = [5] * (bs + 8)  # a stock prompt ends inside a block
    long = [(i % 500) + 10 for i in range(40 * bs)]

    async def scenario():
        gen.defer([], also=[odd, long])
        for f in [gen._pending[tuple(odd)], gen._pending[tuple(long)]]:
            await asyncio.wrap_future(f)

    asyncio.run(scenario())
    parts = [len(r.prompt_ids) - 1 for r in engine.requests if r.prompt_ids[:-1] == long[: len(r.prompt_ids) - 1]]
    assert parts[-1] == len(long)
    # each batch after the first: one part of `limit` new tokens (the last: what is left)
    assert all(b - a == limit for a, b in itertools.pairwise(parts[:-1])), parts
