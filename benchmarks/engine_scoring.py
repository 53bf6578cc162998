"""Log-probabilities of a continuation read from a vLLM engine, the prefix cache in use.

`score` runs `[prompt][continuation]` as one request with prompt log-probabilities, and keeps reading the prefix
cache (vLLM turns that off for prompt log-probabilities by default, since cached rows have none): the cached
blocks (a span engine's spans, moved) are read, the rest is computed, and the rows of the continuation — the
next-token distributions after the prompt and after each prefix of the continuation — are returned as the engine
computed them. Rows come as the top `k` tokens plus the continuation's own token (what vLLM returns); there is no
full vocabulary. `greedy` is a plain greedy answer. Both take the engine (`SpanEngine`) directly and return plain
data, so that a benchmark's stock engine in another process (`ProcessBackend.on_engine`) runs them too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["TOP_K", "argmax", "greedy", "kl_top_k", "score"]

TOP_K = 20  # vLLM's default limit on returned log-probabilities


class CachedRowsError(RuntimeError):
    """The continuation's rows were read from the cache, so the engine computed no distribution for them."""


async def score(
    engine: Any, prompt: Sequence[int], continuation: Sequence[int], table: Any = None, k: int = TOP_K
) -> dict[str, Any]:
    """`{"rows": [{token: logprob}, ...], "own": [logprob, ...], "cached": n}`: per continuation token, the top-k
    of its row and the logprob of the token itself; `table` is the span table of the prompt (None: none)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=k, skip_reading_prefix_cache=False, detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    ids = list(prompt) + list(continuation)
    outs, _ = await engine.run_tokens(ids, params, table)
    out = outs[-1]
    n = len(prompt)
    cached = out.num_cached_tokens or 0
    if cached > n - 1:  # the row that predicts the continuation's first token was not computed
        raise CachedRowsError(f"{cached} of {len(ids)} tokens were cached; rows from {n - 1} are needed")
    rows = [{int(t): float(lp.logprob) for t, lp in out.prompt_logprobs[n + i].items()} for i in range(len(continuation))]
    return {"rows": rows, "own": [row[t] for row, t in zip(rows, continuation)], "cached": cached}


async def greedy(engine: Any, prompt: Sequence[int], max_tokens: int, table: Any = None) -> str:
    """The greedy answer to `prompt` (token ids, laid out by `table`)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    outs, _ = await engine.run_tokens(list(prompt), params, table)
    return "".join(o.outputs[0].text for o in outs if o.outputs)


def argmax(row: dict[int, float]) -> int:
    return max(row, key=row.__getitem__)


def kl_top_k(p_row: dict[int, float], q_row: dict[int, float], k: int = TOP_K) -> float:
    """KL(p || q) in nats over p's top-k tokens and one bucket for all others: a lower bound on the full KL (a
    coarser partition never has more). A token of p's top-k that q does not list gets q's k-th logprob, an upper
    bound on its probability there, so the estimate errs low again."""
    top = sorted(p_row.items(), key=lambda kv: -kv[1])[:k]
    q_listed = sorted(q_row.values(), reverse=True)
    q_floor = q_listed[min(k, len(q_listed)) - 1]
    kl, p_in, q_in = 0.0, 0.0, 0.0
    for t, lp in top:
        lq = q_row.get(t, q_floor)
        p, q = math.exp(lp), math.exp(lq)
        kl += p * (lp - lq)
        p_in += p
        q_in += q
    p_rest, q_rest = max(0.0, 1.0 - p_in), max(1e-12, 1.0 - q_in)
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(0.0, kl)
