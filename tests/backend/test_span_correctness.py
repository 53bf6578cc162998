"""The correctness test that matters most: spans reused in another order give exactly span attention.

Four fragments run in order ABCD, then DCBA on the embedded engine (tiny random Llama). The second run must
hit the cache for every span, and its output log-probabilities must equal an independent HF transformers
reference (each span computed alone after its anchor at its new position, then the rest) to fp32 tolerance.
The same holds for a judge over three inner generations.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from benchmarks.hf_span import full_attention_logprobs, span_reference_logprobs
from spanq_integrations import cross, fragment, generate, plus, system, user
from spanq_integrations.runtime.executor import aexecute

pytestmark = [pytest.mark.vllm]

DOCS = {
    c: f"Document {c}. " + " ".join(f"The {w} of {c} is {i}." for i, w in enumerate(["key", "door", "lamp", "road", "tree", "bell", "cup"] * 3))
    for c in "ABCD"
}
TOL = 2e-4


@pytest.fixture(scope="module")
def engine(tiny_model):
    from spanq_backend.serving.engine import SpanEngine

    eng = SpanEngine(model=str(tiny_model), block_size=32, max_model_len=2048, max_num_seqs=8)
    yield eng
    eng.close()


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


def test_reordered_spans_hit_cache_and_match_reference(engine, hf_model):
    async def scenario():
        first = await run_with_logprobs(engine, rag_query("ABCD"))
        second = await run_with_logprobs(engine, rag_query("DCBA"))
        return first, second

    (lw1, prep1, _, tok1, lp1), (lw2, prep2, out2, tok2, lp2) = asyncio.run(scenario())
    assert prep1 == 4, "all four spans were new on the first run"
    assert prep2 == 0, "the second run found every span already cached"
    span_tokens = sum(e - s for s, e in lw2.table.spans)
    assert out2.num_cached_tokens >= lw2.table.anchor_len + span_tokens, (
        f"cached {out2.num_cached_tokens} tokens; anchor + spans are {lw2.table.anchor_len + span_tokens}"
    )
    # The same fragment has the same tokens wherever it sits.
    assert [lw2.span_ids(i) for i in range(4)] == [lw1.span_ids(3 - i) for i in range(4)]

    for lowered, tokens, lps in ((lw1, tok1, lp1), (lw2, tok2, lp2)):
        ref = span_reference_logprobs(hf_model, lowered.token_ids, lowered.table, tokens).double()
        assert torch.allclose(lps, ref, atol=TOL), f"max |diff| = {(lps - ref).abs().max():.2e}"

    # Span attention is not full attention: the reference must be able to tell them apart.
    full = full_attention_logprobs(hf_model, lw2.token_ids, tok2).double()
    assert (full - lp2).abs().max() > 10 * TOL


def test_nested_judge_reuses_inner_generations_and_matches_reference(engine, hf_model):
    """Plus distribution: the judge reads each inner generation (prompt + output) as one span, reusing the KV
    the generation left in the cache; only each span's partial trailing block is computed again."""
    # Sampled inner outputs (seeded), so the three candidates differ even on a random model.
    inner = [
        generate(cross(system("Write one line."), user(f"Describe the {w}.")), max_tokens=40, temperature=1.0, seed=s)
        for s, w in enumerate(("key", "lamp", "bell"))
    ]
    judge = generate(cross(system("Pick the best line."), plus(*inner), user("Which is best?")), max_tokens=5, temperature=0.0)

    async def scenario():
        from spanq_backend.serving.embedded import EmbeddedBackend

        backend = EmbeddedBackend(engine=engine)
        result = await aexecute(judge, backend)
        closed_outer = result.tree.source
        return result, await run_with_logprobs(engine, closed_outer)

    result, (lowered, prepared, _, tokens, lps) = asyncio.run(scenario())
    assert len(result.calls) == 4
    candidates = [c.text for c in result.tree.source.input.children[1].children]
    assert len(set(candidates)) == 3, candidates
    assert len(lowered.table.spans) == 3
    assert lowered.table.anchors == (0, 0, 0), "each inner generation is a stand-alone span"
    outer = result.calls[-1]
    span_tokens = sum(e - s for s, e in lowered.table.spans)
    # What the judge's prepares computed: the trailing block of each inner generation, and the judge's own prompt
    # prefix (new to the engine, computed beside the spans so the cache lookup reaches them).
    computed = outer.prepared_tokens
    assert 0 < computed <= 3 * engine.config.block_size + lowered.table.anchor_len, (
        f"the judge computed {computed} of {span_tokens} span tokens: only trailing blocks should be new"
    )
    assert prepared == 0, "the judge's spans were cached by the first run of the same judge"
    ref = span_reference_logprobs(
        hf_model, lowered.token_ids, lowered.table.spans, tokens, anchors=[0, 0, 0]
    ).double()
    assert torch.allclose(lps, ref, atol=TOL), f"max |diff| = {(lps - ref).abs().max():.2e}"


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
