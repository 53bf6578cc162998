"""The correctness test that matters most: spans reused in another order give exactly span attention.

Four fragments run in order ABCD, then DCBA on the embedded engine (tiny random Llama). The second run must
hit the cache for every span, and its output log-probabilities must equal an independent HF transformers
reference (each span computed alone after its anchor at its new position, then the rest) to fp32 tolerance.
The same holds for a judge over three inner generations.
"""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from benchmarks.hf_span import full_attention_logprobs, span_reference_logprobs
from spanq_integrations import cross, fragment, generate, plus, system, user
from spanq_integrations.runtime.executor import aexecute
from tests.backend.settings import temporarily

pytestmark = [pytest.mark.vllm]

DOCS = {
    c: f"Document {c}. " + " ".join(f"The {w} of {c} is {i}." for i, w in enumerate(["key", "door", "lamp", "road", "tree", "bell", "cup"] * 3))
    for c in "ABCD"
}
TOL = 2e-4



def rag_query(order: str, question: str = "Which door is open?", max_tokens: int = 6):
    return generate(
        cross(system("Answer from the documents."), plus(*[fragment(DOCS[c]) for c in order]), user(question)),
        max_tokens=max_tokens,
        temperature=0.0,
    )


async def run_with_logprobs(engine, call):
    """Lower, prepare and run one generate on the engine, returning (lowered, output, token ids, logprobs)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    lowered = engine.lower(call)
    prepared = await engine.prepare(lowered) if lowered.has_spans else 0
    params = SamplingParams(
        max_tokens=call.max_tokens, temperature=0.0, logprobs=0, output_kind=RequestOutputKind.DELTA
    )
    outs, _ = await engine.run_tokens(lowered.token_ids, params, lowered.table)
    tokens, logprobs = [], []
    for o in outs:
        c = o.outputs[0]
        for t, lp in zip(c.token_ids, c.logprobs or []):
            tokens.append(t)
            logprobs.append(lp[t].logprob)
    return lowered, prepared, outs[-1], tokens, torch.tensor(logprobs, dtype=torch.float64)


@pytest.fixture(scope="module")
def compiled_engine(tiny_model):
    """An engine whose model runs compiled (torch.compile; `spanq serve --no-enforce-eager`, vLLM's own default),
    where every other test's runs eager (spanq's CPU default: it starts in seconds)."""
    from spanq_backend.serving.engine import SpanEngine

    eng = SpanEngine(model=str(tiny_model), block_size=32, max_model_len=2048, max_num_seqs=8, cold_spans="isolate",
                     recompute=0, enforce_eager=False)
    assert not eng.config.engine_options()["enforce_eager"]
    yield eng
    eng.close()


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_reordered_spans_hit_cache_and_match_reference(request, hf_model, mode):
    """The same documents read in another order: every span from the cache, moved, and the answer span
    attention's. (By default a set is read in one order whatever order it is given, `lowering.span_order`: the
    engine keeps the order given here, so that the second read puts each document somewhere else.) The same
    with the model compiled: the span table changes only what the attention reads, outside the compiled graph."""
    engine = request.getfixturevalue("engine" if mode == "eager" else "compiled_engine")
    async def scenario():
        first = await run_with_logprobs(engine, rag_query("ABCD"))
        second = await run_with_logprobs(engine, rag_query("DCBA"))
        return first, second

    assert engine.lower(rag_query("DCBA")).span_texts == engine.lower(rag_query("ABCD")).span_texts  # by default
    with temporarily(engine.generator, keep_span_order=True):
        (lw1, prep1, _, tok1, lp1), (lw2, prep2, out2, tok2, lp2) = asyncio.run(scenario())
    assert prep1 == 4, "all four spans were new on the first run"
    assert prep2 == 0, "the second run found every span already cached"
    span_tokens = sum(e - s for s, e in lw2.table.spans)
    assert out2.num_cached_tokens >= lw2.table.anchor_len + span_tokens, (
        f"cached {out2.num_cached_tokens} tokens; anchor + spans are {lw2.table.anchor_len + span_tokens}"
    )
    # The same fragment is the same prepared span wherever it sits (last, its tail is read as context).
    assert [lw2.prepare_prompt(i) for i in range(4)] == [lw1.prepare_prompt(3 - i) for i in range(4)]
    assert [lw2.span_ids(i) for i in (1, 2)] == [lw1.span_ids(3 - i) for i in (1, 2)]  # neither last

    for lowered, tokens, lps in ((lw1, tok1, lp1), (lw2, tok2, lp2)):
        ref = span_reference_logprobs(hf_model, lowered.token_ids, lowered.table, tokens).double()
        assert torch.allclose(lps, ref, atol=TOL), f"max |diff| = {(lps - ref).abs().max():.2e}"

    # Span attention is not full attention: the reference must be able to tell them apart.
    full = full_attention_logprobs(hf_model, lw2.token_ids, tok2).double()
    assert (full - lp2).abs().max() > 10 * TOL


def squeeze_newlines(text: str) -> str:
    return re.sub(r"\n+", "\n", text)


def nested_judge(n: int, tag: str):
    words = ["key", "lamp", "bell", "cup", "road", "tree", "door", "coin"]
    inner = [
        generate(cross(system("Write one line."), user(f"Describe the {words[i % 8]} {tag}{i}.")),
                 max_tokens=40, temperature=1.0, seed=i)
        for i in range(n)
    ]  # sampled (seeded), so the candidates differ even on a random model
    return generate(cross(system("Pick the best line."), plus(*inner), user("Which is best?")), max_tokens=5, temperature=0.0)


@pytest.mark.parametrize("n", [3, 24])
def test_nested_judge_reads_only_the_candidates_reusing_their_kv_and_matches_reference(engine, hf_model, n):
    """Plus distribution: the judge reads each inner generation's output alone, as a span anchored on the
    inner prompt, reusing the KV the generation left (its last block sealed when it finished): the judge's
    prompt is the stock judge's plus padding, and it computes none of the candidates again."""
    from spanq_backend.serving.embedded import EmbeddedBackend
    from spanq_integrations.query.flatten import to_chat_messages

    judge = nested_judge(n, f"n{n}")

    async def scenario():
        result = await aexecute(judge, EmbeddedBackend(engine=engine))
        return result, await run_with_logprobs(engine, result.tree.source)

    result, (lowered, prepared, _, tokens, lps) = asyncio.run(scenario())
    assert len(result.calls) == n + 1
    closed = result.tree.source
    candidates = closed.input.children[1].children
    assert len({c.text for c in candidates}) == n
    tok = engine.tokenizer
    known = [engine.generator.generated_ids(c) for c in candidates]
    # An output the engine cannot spell exactly as its text (on this random model: a special token inside it,
    # which the text skips) is read as text; every other one is a span of its output ids.
    as_text = [c for c, k in zip(candidates, known) if k is None]
    assert len(as_text) <= n // 8, f"{len(as_text)} of {n} candidates read as text"
    sealed = sum(c.extra["sealed_outputs"] for c in result.calls if c.path != "$")
    outer = result.calls[-1]
    assert outer.path == "$" and outer.extra["generated_spans"] == sealed == n - len(as_text)
    assert outer.extra["generated_as_text"] == len(as_text)
    assert len(lowered.table.spans) == n
    anchors = lowered.table.anchors
    assert all(a == k.prompt_ids for a, k in zip(anchors, known) if k is not None), "anchored on its own prompt"
    assert all(len(k.prompt_ids) % engine.config.block_size == 0 for k in known if k), "outputs start on a block"

    # The judge's prompt is the stock judge's text plus padding (newlines): the candidates' output ids stand
    # where the stock prompt re-tokenizes their text, and each span is tokenized apart from its neighbours (a
    # token can merge across a boundary in the stock prompt, at most one per boundary).
    stock_text = tok.apply_chat_template(to_chat_messages(closed.input), tokenize=False, add_generation_prompt=True)
    stock = tok.encode(stock_text, add_special_tokens=False)
    assert squeeze_newlines(tok.decode(lowered.token_ids)) == squeeze_newlines(stock_text)
    retokenized = sum(
        len(k.output_ids) - len(tok.encode(c.text, add_special_tokens=False)) for k, c in zip(known, candidates) if k
    )
    assert abs(outer.prompt_tokens - outer.padded_tokens - retokenized - len(stock)) <= n + 1
    assert outer.prompt_tokens - outer.padded_tokens < 1.1 * len(stock), "not the inner prompts again"

    # The judge computes no candidate it knows again: only those read as text (after their anchor, which the
    # cache may not hold: a text span's anchor is the engine's lead-in, not a candidate's prompt), and its own
    # prefix (new here).
    bs = engine.config.block_size
    text_tokens = sum(e - s for (s, e), k in zip(lowered.table.spans, known) if k is None)
    prefix = tuple(lowered.prefix_prompt())
    text_anchors = {tuple(lowered.table.anchor_ids(i, lowered.token_ids)) for i, k in enumerate(known) if k is None}
    anchor_tokens = sum(len(a) for a in text_anchors - {prefix})
    assert outer.prepared_spans == len(as_text)
    assert outer.prepared_tokens <= lowered.table.anchor_len + anchor_tokens + text_tokens + bs * len(as_text)
    known_tokens = sum(e - s for (s, e), k in zip(lowered.table.spans, known) if k is not None)
    assert outer.cached_tokens >= known_tokens, "the known candidates' KV existed before the judge's call"
    assert prepared == 0

    ref = span_reference_logprobs(hf_model, lowered.token_ids, lowered.table, tokens).double()
    assert torch.allclose(lps, ref, atol=TOL), f"max |diff| = {(lps - ref).abs().max():.2e}"
    # The reference tells the candidates' own prompts from the judge's prefix as their anchor.
    on_prefix = span_reference_logprobs(hf_model, lowered.token_ids, lowered.table.spans, tokens).double()
    assert (on_prefix - lps).abs().max() > 10 * TOL


def test_a_judge_whose_candidates_were_evicted_computes_them_again_with_the_same_answer(engine, hf_model):
    """The engine no longer holds the candidates' KV: the judge's prepares compute it again (said in its
    metadata), and its log-probabilities still equal the reference."""
    from spanq_backend.serving.embedded import EmbeddedBackend

    judge = nested_judge(3, "evicted")

    async def scenario():
        result = await aexecute(judge, EmbeddedBackend(engine=engine))
        assert engine.reset_prefix_cache(), "the engine's prefix cache could not be reset"
        return result, await aexecute(result.tree.source.model_copy(update={"max_tokens": 5}), EmbeddedBackend(engine=engine))

    first, again = asyncio.run(scenario())
    call = again.calls[-1]
    assert call.extra["generated_spans"] == 3
    assert call.prepared_spans == 3 and call.prepared_tokens > 0 and call.cached_tokens == 0
    assert again.answer == first.answer

def test_two_spans_sharing_their_first_block_match_reference(engine, hf_model):
    """Two fragments whose first block holds the same tokens hash to one cached block, which the request then
    reads at two positions: the second use gets a private copy (CIDRA), so both read the right keys."""
    from spanq_backend import vllm_integration as vllm_plugin

    header = "Shared header: " + " ".join(f"field {i} is reserved." for i in range(12))  # > one block of tokens
    shared = {
        "X": header + " The door of X is green. " + DOCS["A"],
        "Y": header + " The door of Y is blue. " + DOCS["B"],
    }
    call = generate(
        cross(system("Answer from the documents."), plus(fragment(shared["X"]), fragment(shared["Y"])),
              user("Which door is blue?")),
        max_tokens=6, temperature=0.0,
    )

    async def scenario():
        first = await run_with_logprobs(engine, call)
        before = vllm_plugin.stats()
        second = await run_with_logprobs(engine, call)
        return first, second, before, vllm_plugin.stats()

    first, second, before, after = asyncio.run(scenario())
    lowered = second[0]
    bs = lowered.table.block_size
    (s0, _), (s1, _) = lowered.table.spans
    assert lowered.token_ids[s0 : s0 + bs] == lowered.token_ids[s1 : s1 + bs], "the test needs a shared first block"
    assert after["duplicates"] > before["duplicates"], "the second use of the shared block was copied"
    for lw, _, _, tokens, lps in (first, second):
        ref = span_reference_logprobs(hf_model, lw.token_ids, lw.table, tokens).double()
        assert torch.allclose(lps, ref, atol=TOL), f"max |diff| = {(lps - ref).abs().max():.2e}"
