"""The engine-vs-HF correctness check can fail: broken relocations are caught by it.

The same harness as the correctness tests (spans prepared in one order, read in another, logprobs compared
with the HF span reference at fp32 tolerance) runs against deliberately broken engines — keys not moved, moved
the wrong way — and against a reference with the wrong semantics (the anchor left at position 0 instead of
moved with its span). Each must miss; the unbroken engine must match. Every case reads documents of its own,
so the keys a broken engine leaves behind are never read by another test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from benchmarks.hf_span import span_reference_logprobs
from spanq_backend.kv.relocation import KVRelocator, Move
from spanq_integrations import cross, fragment, generate, plus, system, user
from tests.backend.logprobs import run_with_logprobs

pytestmark = [pytest.mark.vllm]

TOL = 2e-4  # the correctness tests' tolerance (tests/backend/test_span_correctness.py)


def docs(tag: str) -> dict[str, str]:
    return {
        c: f"Record {c}{tag}. " + " ".join(f"{c.lower()}{tag} slot {i} holds {i * 5 % 13}." for i in range(16))
        for c in "ABCD"
    }


def query(d: dict[str, str], order: str):
    return generate(
        cross(system("Answer from the records."), plus(*[fragment(d[c]) for c in order]), user("Which slot holds 4?")),
        max_tokens=6,
        temperature=0.0,
    )



def reordered_run(engine, tag: str):
    """Prepare ABCD, then run DBCA with logprobs: every span is read at a new position."""
    d = docs(tag)

    async def scenario():
        await engine.prepare(engine.lower(query(d, "ABCD")))
        lowered = engine.lower(query(d, "DBCA"))
        await engine.prepare(lowered)
        return (lowered, *await run_with_logprobs(engine, lowered, 6))

    return asyncio.run(scenario())


def matches(lps: torch.Tensor, ref: torch.Tensor) -> bool:
    return lps.shape == ref.shape and torch.allclose(lps, ref, atol=TOL)


def _no_moves(orig):
    def apply(self, moves: Sequence[Move]) -> None:
        self.moved_blocks += 0

    return apply


def _negated(orig):
    def apply(self, moves: Sequence[Move]) -> None:
        orig(self, [Move(b, -d) for b, d in moves])

    return apply


@pytest.mark.parametrize(
    "mutation",
    [None, _no_moves, _negated],
    ids=["unbroken", "relocation-off", "delta-negated"],
)
def test_the_reference_check_catches_a_broken_relocation(engine, hf_model, monkeypatch, mutation):
    if mutation is not None:
        monkeypatch.setattr(KVRelocator, "apply", mutation(KVRelocator.apply))
    name = "unbroken" if mutation is None else mutation.__name__
    lowered, cached, toks, lps = reordered_run(engine, f"m{name}")
    assert cached >= lowered.table.spans[-1][1], "every span came from the cache, at a new position"
    ref = span_reference_logprobs(hf_model, lowered.token_ids, lowered.table, toks).double()
    if mutation is None:
        assert matches(lps, ref), f"max |diff| = {(lps - ref).abs().max():.2e}"
    else:
        assert not matches(lps, ref), f"the {name} engine passed the reference check"


@torch.no_grad()
def anchor_left_at_zero_logprobs(model, token_ids, table, continuation) -> torch.Tensor:
    """The wrong semantics: each span computed at its new position with its anchor left at positions 0..n-1
    (not moved to sit right before it), then the rest of the prompt after all of it."""
    from benchmarks.hf_span import _kv, _SpanKV

    ids, cont, spans = list(token_ids), list(continuation), table.spans
    a = spans[0][0]
    kv = _SpanKV()
    out = model(torch.tensor([ids[:a]]), position_ids=torch.arange(a).unsqueeze(0), use_cache=True)
    kv.append(_kv(out.past_key_values))
    pos = a
    for s, e in spans:
        if s > pos:
            out = model(torch.tensor([ids[pos:s]]), position_ids=torch.arange(pos, s).unsqueeze(0),
                        past_key_values=kv.cache(), use_cache=True)
            kv.append(_kv(out.past_key_values), lo=pos)
        own = table.anchor_ids(list(spans).index((s, e)), ids)
        positions = torch.cat([torch.arange(len(own)), torch.arange(s, e)]).unsqueeze(0)
        out = model(torch.tensor([own + ids[s:e]]), position_ids=positions, use_cache=True)
        kv.append(_kv(out.past_key_values), lo=len(own))
        pos = e
    rest = ids[pos:] + cont
    out = model(torch.tensor([rest]), position_ids=torch.arange(pos, pos + len(rest)).unsqueeze(0),
                past_key_values=kv.cache(), use_cache=True)
    logp = torch.log_softmax(out.logits[0].float(), dim=-1)
    first = len(ids) - pos - 1
    rows = logp[first : first + len(cont)]
    return rows[torch.arange(len(cont)), torch.tensor(cont)]


def test_the_reference_check_tells_the_anchor_moved_with_its_span_from_the_anchor_left_at_zero(engine, hf_model):
    lowered, _, toks, lps = reordered_run(engine, "anchor0")
    right = span_reference_logprobs(hf_model, lowered.token_ids, lowered.table, toks).double()
    wrong = anchor_left_at_zero_logprobs(hf_model, lowered.token_ids, lowered.table, toks).double()
    assert matches(lps, right)
    assert not matches(lps, wrong), f"the tolerance cannot tell the semantics apart: {(lps - wrong).abs().max():.2e}"
