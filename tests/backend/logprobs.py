"""One greedy request on an in-process `SpanEngine`, with the log-probability of each generated token: what the
correctness tests compare with the HF reference."""

from __future__ import annotations

from typing import Any

import torch


async def run_with_logprobs(engine: Any, lowered: Any, max_tokens: int, with_table: bool = True):
    """`(cached tokens, generated tokens, their logprobs)` of `lowered` run with its span table (or without)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, output_kind=RequestOutputKind.DELTA)
    outs, _ = await engine.run_tokens(lowered.token_ids, params, lowered.table if with_table else None)
    toks = [t for o in outs for t in o.outputs[0].token_ids]
    lps = [lp[t].logprob for o in outs for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [])]
    return outs[-1].num_cached_tokens or 0, toks, torch.tensor(lps, dtype=torch.float64)


def greedy_runs(engine: Any, prompts: list[list[int]], max_tokens: int = 8) -> list[dict[str, Any]]:
    """Each prompt (token ids, no span table) run greedily, one after another: its tokens, their logprobs and
    how many prompt tokens it found cached. Runs its own event loop; plain data, so it crosses processes."""
    import asyncio

    async def run() -> list[dict[str, Any]]:
        out = []
        for ids in prompts:
            cached, toks, lps = await run_with_logprobs(engine, _Prompt(ids), max_tokens, with_table=False)
            out.append({"tokens": toks, "logprobs": lps.tolist(), "cached": cached})
        return out

    return asyncio.run(run())


class _Prompt:
    """Token ids in the shape `run_with_logprobs` reads (a prompt without spans)."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self.table = None
