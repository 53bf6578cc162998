"""The HF reference's attention weights under span attention (`benchmarks.hf_span.span_attention_weights`), which
`scripts/quality_experiments.py criteria` ranks span blocks by (docs/benchmarks.md, "quality").

At layer 0 a token's query and key depend on the token and its position alone, so what the question reads there
is the same under span attention and full attention: the weights must equal full attention's. Past layer 0 the
spans' keys differ (each span computed after its anchor alone), so the weights must differ: a helper that ran
full attention, or put the spans' keys at other positions, fails one of the two checks.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.hf_span import span_attention_weights
from spanq_backend.serving.generator import load_chat_tokenizer
from spanq_backend.serving.lowering import lower
from spanq_integrations import cross, fragment, generate, plus, system, user


@pytest.fixture(scope="module")
def lowered(tiny_model):
    tokenizer = load_chat_tokenizer(tiny_model)
    pad = tokenizer.encode("\n", add_special_tokens=False)[-1]
    docs = [f"Document {c}. " + " ".join(f"The {w} of {c} is {i}." for i, w in enumerate(["key", "lamp", "bell"] * 4))
            for c in "ABC"]
    call = generate(cross(system("Answer from the documents."), plus(*[fragment(d) for d in docs]),
                          user("Which lamp is lit?")), max_tokens=4, temperature=0.0)
    return lower(call.input, tokenizer, 16, pad)


@torch.no_grad()
def full_attention_weights(model, token_ids, rows_from):
    had = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(torch.tensor([list(token_ids)]), output_attentions=True, logits_to_keep=1)
    finally:
        model.set_attn_implementation(had)
    return [a[0, :, rows_from:, :] for a in out.attentions]


def test_the_question_reads_layer_0_as_under_full_attention_and_the_spans_differently_after(hf_model, lowered):
    table = lowered.table
    after = table.spans[-1][1]
    had = hf_model.config._attn_implementation
    span = span_attention_weights(hf_model, lowered.token_ids, table)
    assert hf_model.config._attn_implementation == had  # eager for that pass only
    full = full_attention_weights(hf_model, lowered.token_ids, after)
    assert len(span) == len(full) == hf_model.config.num_hidden_layers
    rows = len(lowered.token_ids) - after
    for w in span:
        assert w.shape == (hf_model.config.num_attention_heads, rows, len(lowered.token_ids))
        torch.testing.assert_close(w.sum(dim=-1), torch.ones(w.shape[:2]), atol=1e-5, rtol=0)
    torch.testing.assert_close(span[0], full[0], atol=1e-5, rtol=0)
    # Past layer 0 the spans' keys were computed after their anchor alone: the question reads them differently.
    assert (span[-1] - full[-1]).abs().max() > 1e-3


def test_a_prompt_that_ends_with_its_last_span_is_refused(hf_model, lowered):
    end = lowered.table.spans[-1][1]
    with pytest.raises(ValueError, match="nothing after the last span"):
        span_attention_weights(hf_model, lowered.token_ids[:end], lowered.table)


def test_a_bias_on_span_logits_keeps_the_causal_mask_and_moves_only_what_reads_spans(hf_model, lowered):
    """`span_bias` (APE's scaling factor, an experiment of `scripts/quality_experiments.py bias`) builds its own
    attention mask: at a bias of ~0 it must give exactly the reference without one (a mask that let a row see the
    rows after it would not), and a bias must change the answer's distributions."""
    from benchmarks.hf_span import span_attention_next_token_logprobs

    cont = [lowered.token_ids[5], lowered.token_ids[9], lowered.token_ids[13]]
    plain = span_attention_next_token_logprobs(hf_model, lowered.token_ids, lowered.table, cont)
    tiny = span_attention_next_token_logprobs(hf_model, lowered.token_ids, lowered.table, cont, span_bias=1e-9)
    torch.testing.assert_close(tiny, plain, atol=1e-5, rtol=0)
    biased = span_attention_next_token_logprobs(hf_model, lowered.token_ids, lowered.table, cont, span_bias=-2.0)
    assert (biased - plain).abs().max() > 1e-3
