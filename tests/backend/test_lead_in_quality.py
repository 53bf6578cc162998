"""What the canonical anchor's lead-in buys (docs/design.md, "The lead-in"), on the default model: documents (the QA
items of `spanq bench quality`) read as spans after the default lead-in give answers closer to full attention than
after the bare template opening. Measured with the HF reference (`benchmarks.hf_span`): the KL from full attention
on the same tokens along the gold answer. An anchor that dropped its lead-in (or a lowering that ignored the
setting) reads as the bare opening and fails the check. (`python scripts/quality_experiments.py leadin` gives the
same rows, and longer lead-ins, over more items with intervals.)"""

from __future__ import annotations

import pytest

from benchmarks import hf_span
from benchmarks.quality import make_items, qa_query
from spanq_backend.serving.generator import load_chat_tokenizer
from spanq_backend.serving.lowering import lower

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(default_model):
    return load_chat_tokenizer(default_model), hf_span.load_hf_model(default_model)


def newline(tokenizer) -> int:
    return tokenizer.encode("\n", add_special_tokens=False)[-1]


def mean_kls(smol, lead_ins: dict[str, str | None], items: int, filler: int) -> dict[str, float]:
    """Per lead-in (None: the default), the mean over the items of the KL (nats/token) from full attention on the
    span layout's tokens to span attention with anchors read after it, nothing recomputed."""
    tokenizer, model = smol
    pad = newline(tokenizer)
    kls: dict[str, list[float]] = {name: [] for name in lead_ins}
    for item in make_items(items, 5, seed=0, filler=filler):
        query = qa_query(item, 16).input
        gold = tokenizer.encode(item.gold, add_special_tokens=False)
        full = None
        for name, lead_in in lead_ins.items():
            low = lower(query, tokenizer, 32, pad, **({} if lead_in is None else {"lead_in": lead_in}))
            if full is None:  # the lead-in lives in the anchors only: every setting reads the same tokens
                full = hf_span.full_attention_next_token_logprobs(model, low.token_ids, gold)
            span = hf_span.span_attention_next_token_logprobs(model, low.token_ids, low.table, gold)
            kls[name].append(float(hf_span.kl_divergence(full, span).mean()))
    return {name: sum(v) / len(v) for name, v in kls.items()}


def test_documents_read_after_the_default_lead_in_are_closer_to_full_attention(smol):
    kl = mean_kls(smol, {"default": None, "none": ""}, items=3, filler=12)
    assert kl["default"] < 0.8 * kl["none"], kl
