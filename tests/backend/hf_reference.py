"""An independent reference for span attention, built with HF transformers (no vLLM).

Each span's KV is computed alone after its anchor, with the anchor moved to sit directly before the span
(DESIGN.md invariant 2); the anchor's own KV is at positions 0..a-1; the rest of the prompt and the
generated tokens then attend to all of it. Returns the log-probabilities of given continuation tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def load_hf_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    return model


def _kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


@torch.no_grad()
def span_reference_logprobs(
    model,
    token_ids: Sequence[int],
    spans: Sequence[tuple[int, int]],
    continuation: Sequence[int],
    anchors: Sequence[int] | None = None,
) -> torch.Tensor:
    """Log-probabilities of `continuation` after `token_ids`, under span attention with exact relocation.

    `spans` are (start, end) offsets; span i's anchor is `token_ids[:anchors[i]]` (default: the prefix before
    the first span). Context between spans attends to everything before it, like the text after the last span.
    """
    from transformers import DynamicCache

    ids = list(token_ids)
    a = spans[0][0]
    anchor = ids[:a]
    layers: list[list[torch.Tensor]] | None = None

    def append(kv: list[tuple[torch.Tensor, torch.Tensor]], lo: int | None = None) -> None:
        nonlocal layers
        if layers is None:
            layers = [[k[:, :, lo:], v[:, :, lo:]] for k, v in kv]
        else:
            for slot, (k, v) in zip(layers, kv):
                slot[0] = torch.cat([slot[0], k[:, :, lo:]], dim=2)
                slot[1] = torch.cat([slot[1], v[:, :, lo:]], dim=2)

    def cache_of_layers() -> DynamicCache:
        cache = DynamicCache()
        for i, (k, v) in enumerate(layers or []):
            cache.update(k.clone(), v.clone(), i)
        return cache

    # The anchor at its own positions.
    out = model(torch.tensor([anchor]), position_ids=torch.arange(a).unsqueeze(0), use_cache=True)
    append(_kv(out.past_key_values))
    pos = a
    for s, e in spans:
        if s > pos:  # context between spans: attends to everything so far
            out = model(
                torch.tensor([ids[pos:s]]), position_ids=torch.arange(pos, s).unsqueeze(0),
                past_key_values=cache_of_layers(), use_cache=True,
            )
            append(_kv(out.past_key_values), lo=pos)
        # The span alone after its anchor, the anchor moved to end right where the span starts.
        own = a if anchors is None else anchors[spans.index((s, e))]
        out = model(
            torch.tensor([ids[:own] + ids[s:e]]), position_ids=torch.arange(s - own, e).unsqueeze(0), use_cache=True
        )
        append(_kv(out.past_key_values), lo=own)
        pos = e
    rest = ids[pos:] + list(continuation)
    out = model(
        torch.tensor([rest]), position_ids=torch.arange(pos, pos + len(rest)).unsqueeze(0),
        past_key_values=cache_of_layers(), use_cache=True,
    )
    logp = torch.log_softmax(out.logits[0].float(), dim=-1)
    n_prompt_rest = len(ids) - pos
    rows = logp[n_prompt_rest - 1 : n_prompt_rest - 1 + len(continuation)]
    return rows[torch.arange(len(continuation)), torch.tensor(list(continuation))]


@torch.no_grad()
def full_attention_logprobs(model, token_ids: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
    """Log-probabilities of `continuation` after `token_ids` with ordinary causal attention (stock)."""
    ids = list(token_ids) + list(continuation)
    out = model(torch.tensor([ids]))
    logp = torch.log_softmax(out.logits[0].float(), dim=-1)
    n = len(token_ids)
    rows = logp[n - 1 : n - 1 + len(continuation)]
    return rows[torch.arange(len(continuation)), torch.tensor(list(continuation))]
