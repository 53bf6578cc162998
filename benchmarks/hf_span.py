"""Span attention and full attention in HF transformers (no vLLM): an independent reference for the engine.

Span attention with exact relocation (invariant 2 of docs/design.md): the anchor's KV sits at positions 0..a-1; each
span's KV is computed alone after the anchor, with the anchor moved to end right where the span starts; context
between spans and everything after the last span attend to all of it. Full attention is the ordinary causal
forward pass over the same tokens. Both return log-probabilities over the whole vocabulary at each position of
a teacher-forced continuation, so they can be compared token by token (KL divergence), or read at the
continuation's own tokens (`*_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "full_attention_logprobs",
    "full_attention_next_token_logprobs",
    "kl_divergence",
    "load_hf_model",
    "span_attention_next_token_logprobs",
    "span_attention_weights",
    "span_reference_logprobs",
]


def load_hf_model(path: str | Path) -> Any:
    """The causal LM in `path`, in float32, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    return model


def _kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


class _SpanKV:
    """Per-layer K/V built piece by piece (anchor, spans, context), and handed to the model as a fresh cache."""

    def __init__(self) -> None:
        self.layers: list[list[torch.Tensor]] | None = None

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], lo: int | None = None) -> None:
        if self.layers is None:
            self.layers = [[k[:, :, lo:], v[:, :, lo:]] for k, v in kv]
            return
        for slot, (k, v) in zip(self.layers, kv):
            slot[0] = torch.cat([slot[0], k[:, :, lo:]], dim=2)
            slot[1] = torch.cat([slot[1], v[:, :, lo:]], dim=2)

    def cache(self) -> Any:
        from transformers import DynamicCache

        cache = DynamicCache()
        for i, (k, v) in enumerate(self.layers or []):
            cache.update(k.clone(), v.clone(), i)
        return cache


@torch.no_grad()
def span_attention_next_token_logprobs(
    model: Any,
    token_ids: Sequence[int],
    spans: Sequence[tuple[int, int]] | Any,
    continuation: Sequence[int],
    anchors: Sequence[int | Sequence[int]] | None = None,
    key_scale: float = 1.0,
    span_bias: float = 0.0,
) -> torch.Tensor:
    """`[len(continuation), vocab]` log-probabilities of the next token after `token_ids` + each prefix of
    `continuation`, under span attention with exact relocation.

    `spans` are (start, end) offsets into `token_ids`, or a span table (its spans and anchors). Span i's
    anchor is `token_ids[:anchors[i]]` for a length (default: the prefix before the first span; 0 for a
    stand-alone span) or the tokens `anchors[i]` themselves, which need not be in the prompt: the span attends to
    them alone, and nothing after the span does. Without spans this is full attention.

    `key_scale` multiplies the spans' cached keys (every layer) after each span is computed: what reads them later
    attends with their logits scaled so, a temperature of 1 / key_scale on span tokens (APE's); 1 leaves them.
    `span_bias` is added to the attention logits the text after the last span gives every span token (every layer
    and head): their attention weights multiplied by e^bias before normalization (APE's scaling factor); 0 leaves
    them.
    """
    if hasattr(spans, "spans"):  # a SpanTable
        table = spans
        spans = table.spans
        anchors = [table.anchor_of(i) for i in range(len(spans))] if anchors is None else anchors
    ids = list(token_ids)
    cont = list(continuation)
    if not spans:
        return full_attention_next_token_logprobs(model, ids, cont)
    kv, last_span_row, pos = _span_kv(model, ids, spans, anchors, key_scale)
    rest = ids[pos:] + cont
    # Logits only for the rows read: from the one that predicts the continuation's first token (the vocabulary
    # projection of every row of the prompt was most of a small model's reference time).
    keep = len(rest) if pos == len(ids) else len(cont) + 1
    mask = None
    if span_bias != 0.0:  # causal over the cache and these rows, the bias on span keys: an additive 4D mask
        keys = torch.arange(pos + len(rest))
        rows = torch.arange(pos, pos + len(rest)).unsqueeze(1)
        mask = torch.zeros(len(rest), len(keys))
        for s, e in spans:
            mask[:, s:e] = span_bias
        mask = mask.masked_fill(keys.unsqueeze(0) > rows, torch.finfo(torch.float32).min)[None, None]
    out = model(
        torch.tensor([rest]), position_ids=torch.arange(pos, pos + len(rest)).unsqueeze(0),
        past_key_values=kv.cache(), use_cache=True, logits_to_keep=keep, attention_mask=mask,
    )
    logits = out.logits[0]
    if pos == len(ids):  # the prompt ends with a span: its own last row predicts the continuation's first token
        logits = torch.cat([last_span_row, logits])
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp[: len(cont)]


@torch.no_grad()
def span_layer_kv(
    model: Any, token_ids: Sequence[int], table: Any
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the K/V span attention reads for `token_ids[:end of the last span]` under `table` (each span
    computed alone after its anchor, keys at their positions in the prompt), `[1, kv heads, tokens, head dim]`."""
    spans = table.spans
    kv, _, _ = _span_kv(model, list(token_ids), spans, [table.anchor_of(i) for i in range(len(spans))])
    return [(k, v) for k, v in kv.layers or []]


@torch.no_grad()
def span_attention_weights(model: Any, token_ids: Sequence[int], table: Any) -> list[torch.Tensor]:
    """Per layer, how the text after the last span attends under span attention: `[heads, rows, keys]`
    probabilities, one row per token after the last span, one key per token of the prompt (the spans' keys as
    span attention cached them). The model runs its eager attention for this pass only (the one that returns
    weights), then the implementation it had."""
    spans = table.spans
    ids = list(token_ids)
    kv, _, pos = _span_kv(model, ids, spans, [table.anchor_of(i) for i in range(len(spans))])
    if pos == len(ids):
        raise ValueError("nothing after the last span attends to the spans")
    had = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(
            torch.tensor([ids[pos:]]), position_ids=torch.arange(pos, len(ids)).unsqueeze(0),
            past_key_values=kv.cache(), use_cache=True, output_attentions=True, logits_to_keep=1,
        )
    finally:
        model.set_attn_implementation(had)
    return [a[0] for a in out.attentions]


@torch.no_grad()
def full_layer_kv(model: Any, token_ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the K/V of `token_ids` under full attention (what recomputing them in context writes)."""
    out = model(torch.tensor([list(token_ids)]), use_cache=True, logits_to_keep=1)  # its logits are not read
    return _kv(out.past_key_values)


def _span_kv(
    model: Any, ids: list[int], spans: Sequence[tuple[int, int]], anchors: Sequence[Any] | None,
    key_scale: float = 1.0,
) -> tuple[_SpanKV, torch.Tensor, int]:
    """The K/V of the prompt up to the last span's end under span attention, the last span's last logits row,
    and where the K/V ends; the spans' keys multiplied by `key_scale`."""
    a = spans[0][0]
    kv = _SpanKV()
    out = model(torch.tensor([ids[:a]]), position_ids=torch.arange(a).unsqueeze(0), use_cache=True, logits_to_keep=1)
    kv.append(_kv(out.past_key_values))
    pos = a
    for s, e in spans:
        if s > pos:  # context between spans: attends to everything so far
            out = model(
                torch.tensor([ids[pos:s]]), position_ids=torch.arange(pos, s).unsqueeze(0),
                past_key_values=kv.cache(), use_cache=True, logits_to_keep=1,
            )
            kv.append(_kv(out.past_key_values), lo=pos)
        # The span alone after its anchor, the anchor moved to end right where the span starts.
        own = a if anchors is None else anchors[list(spans).index((s, e))]
        own_ids = ids[:own] if isinstance(own, int) else list(own)
        n = len(own_ids)
        out = model(
            torch.tensor([own_ids + ids[s:e]]), position_ids=torch.arange(s - n, e).unsqueeze(0), use_cache=True,
            logits_to_keep=1,  # only the last row is read (where the prompt ends with this span)
        )
        own_kv = _kv(out.past_key_values)
        if key_scale != 1.0:
            own_kv = [(k * key_scale, v) for k, v in own_kv]
        kv.append(own_kv, lo=n)
        last_span_row = out.logits[0, -1:]
        pos = e
    return kv, last_span_row, pos


@torch.no_grad()
def full_attention_next_token_logprobs(
    model: Any, token_ids: Sequence[int], continuation: Sequence[int]
) -> torch.Tensor:
    """`[len(continuation), vocab]` log-probabilities under ordinary causal attention (stock)."""
    ids = list(token_ids) + list(continuation)
    out = model(torch.tensor([ids]), logits_to_keep=len(continuation) + 1)  # the rows read, from the prompt's last
    logp = torch.log_softmax(out.logits[0].float(), dim=-1)
    return logp[: len(continuation)]


def _at(rows: torch.Tensor, continuation: Sequence[int]) -> torch.Tensor:
    return rows[torch.arange(len(continuation)), torch.tensor(list(continuation), dtype=torch.long)]


def span_reference_logprobs(
    model: Any,
    token_ids: Sequence[int],
    spans: Sequence[tuple[int, int]] | Any,
    continuation: Sequence[int],
    anchors: Sequence[int | Sequence[int]] | None = None,
) -> torch.Tensor:
    """Log-probabilities of `continuation`'s own tokens under span attention (see the module docstring)."""
    return _at(span_attention_next_token_logprobs(model, token_ids, spans, continuation, anchors), continuation)


def full_attention_logprobs(model: Any, token_ids: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
    """Log-probabilities of `continuation`'s own tokens under ordinary causal attention."""
    return _at(full_attention_next_token_logprobs(model, token_ids, continuation), continuation)


def kl_divergence(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, in nats, of two `[rows, vocab]` log-probability tensors."""
    p = p_logprobs.double()
    q = q_logprobs.double()
    return (p.exp() * (p - q)).sum(dim=-1)
