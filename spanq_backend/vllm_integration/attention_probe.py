"""The attention probe: how much of the question's attention each KV block of a prompt receives, at one layer in
the middle of the model, read in the engine's own forward pass (`recompute="attention"`, docs/design.md,
"Recompute").

A request marked with `PROBE_PARAM` in its `SamplingParams.extra_args` (`probe_params`) is read, at the probe
layer, by a hook after vLLM's CPU attention (`wrap_cpu_attention_forward`): for the rows of the prompt from
`rows_from` on that the step computes (the question, where nothing after the spans is cached), the softmax of the
rows' queries against every key of the request's blocks (the cached spans' keys as they sit, after this step's
moves; the causal mask by position), summed over heads and rows, then over each block's tokens. The request's
result (per prompt block, in prompt order; `rows`: how many rows were read) is kept in this process until it is
taken: in process by `take`, from `spanq serve`'s engine process through vLLM's `collective_rpc`
(`SCORES_METHOD`, installed on `WorkerBase`).

Only where spanq reads the cache's keys itself and the attention is plain causal softmax attention: vLLM's CPU
backend, no sliding window shorter than the context, no ALiBi, no logit soft-capping, no attention sinks, a step's
metadata one causal row range per request. Anywhere else the result says why it is missing (`error`), and the
generator falls back to the question's words, saying so.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "PROBE_PARAM",
    "SCORES_METHOD",
    "Probes",
    "attention_mass",
    "combine_workers",
    "probe_params",
    "take",
    "worker_attention_scores",
]

PROBE_PARAM = "spanq_attention_probe"  # key in a request's extra_args: {"id": str, "rows_from": int}
SCORES_METHOD = "spanq_attention_scores"  # on vLLM's WorkerBase: (probe id) -> its result, taken

_lock = threading.Lock()
_results: dict[str, dict[str, Any]] = {}  # probe id -> {"blocks": [...], "rows": n, "layer": name} or {"error": why}
MAX_KEPT = 256  # results nobody took (a cancelled call) are dropped oldest first
# How the probes refer to their runner: weakly. `worker.runner_spans` keeps a runner's span state in a weak-key
# dictionary; a strong reference from that state back to the runner would keep every runner (and its KV cache)
# of the process alive after its engine closed.
_hold = weakref.ref
CHUNK_ELEMENTS = 1 << 24  # logits computed at once by `attention_mass` (64 MiB of fp32)


def probe_params(probe_id: str, rows_from: int) -> dict[str, Any]:
    """The `extra_args` entry that marks a request for the probe: read the rows from `rows_from` on."""
    return {PROBE_PARAM: {"id": probe_id, "rows_from": int(rows_from)}}


def _keep(probe_id: str, result: dict[str, Any]) -> None:
    with _lock:
        _results.pop(probe_id, None)  # the newest last: a result still growing is not the first dropped
        _results[probe_id] = result
        while len(_results) > MAX_KEPT:
            del _results[next(iter(_results))]


def take(probe_id: str) -> dict[str, Any] | None:
    """The probe's result, removed (None: none kept in this process)."""
    with _lock:
        return _results.pop(probe_id, None)


def worker_attention_scores(_worker_base: Any, probe_id: str) -> dict[str, Any] | None:
    """Installed on vLLM's `WorkerBase` as `SCORES_METHOD`: `take` in the worker's process."""
    return take(probe_id)


def combine_workers(answers: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One probe's result from every worker of an engine (`collective_rpc`, one answer per worker): tensor-parallel
    workers each read their own heads, so the mass per block is the sum of all of theirs. None where no worker kept
    one; an error where any says why, or where only some kept one (a sum over some heads is not the layer's)."""
    kept = [a for a in answers if a]
    if not kept:
        return None
    error = next((a for a in kept if "error" in a), None)
    if error is not None:
        return error
    if len(kept) < len(answers):
        return {"error": f"only {len(kept)} of the engine's {len(answers)} workers kept the probe's result"}
    if len({int(a["rows"]) for a in kept}) > 1 or len({len(a["blocks"]) for a in kept}) > 1:
        return {"error": "the engine's workers read different rows or blocks for the probe"}
    return {**kept[0], "blocks": [sum(col) for col in zip(*(a["blocks"] for a in kept))]}


def _unsupported_metadata(meta: Any, requests: int) -> str:
    """Why a step's attention metadata is not one causal row range per request, as `Probes.read` reads it."""
    if getattr(meta, "causal", True) is not True or getattr(meta, "dynamic_causal", None) is not None:
        return "the probe layer's attention is not causal in this step"
    if len(meta.query_start_loc) != requests + 1 or len(meta.seq_lens) < requests:
        return "the probe layer's attention metadata is not one row range per request (local or virtual batches)"
    return ""


@dataclass
class _Active:
    probe_id: str
    rows_from: int
    mass: torch.Tensor | None = None  # per prompt token, summed over the rows read so far
    rows: int = 0
    read_to: int = 0  # rows before this position are read (a request preempted and resumed computes them again)
    error: str = ""


@dataclass
class Probes:
    """Per span runtime (one model runner): the probes of the requests it runs, and the layer they read."""

    runner: Any  # a weak reference (`weakref.ref`): the runner's own state must not keep it, and its KV cache, alive
    read_keys: Any  # (layer's cache, block id) -> keys [block_size, kv_heads, head_dim]; None: not readable here
    layer_name: str  # the attention layer read: the middle one of the model's
    block_size: int
    unsupported: str = ""  # why no probe can be read on this runner
    max_model_len: int = 0
    active: dict[str, _Active] = field(default_factory=dict)

    def start(self, req_id: str, extra_args: dict[str, Any] | None) -> None:
        spec = (extra_args or {}).get(PROBE_PARAM)
        if not isinstance(spec, dict) or "id" not in spec:
            return
        probe = _Active(str(spec["id"]), int(spec.get("rows_from", 0)))
        if self.unsupported:
            _keep(probe.probe_id, {"error": self.unsupported})
            return
        self.active[req_id] = probe

    def finish(self, req_id: str) -> None:
        self.active.pop(req_id, None)

    def _store(self, probe: _Active) -> None:
        """The result so far (a prompt chunked over steps adds to it): kept as soon as a step has read it, since
        the request's output can reach the caller before the engine's next step says it finished."""
        if probe.error or probe.mass is None:
            _keep(probe.probe_id, {"error": probe.error or "the probe layer computed none of the rows asked"})
            return
        bs = self.block_size
        n = probe.mass.numel()
        padded = torch.zeros((n + bs - 1) // bs * bs, dtype=torch.float64)
        padded[:n] = probe.mass
        _keep(probe.probe_id, {"blocks": padded.view(-1, bs).sum(dim=1).tolist(), "rows": probe.rows,
                               "layer": self.layer_name})

    def read(self, impl: Any, query: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> None:
        """After the probe layer's attention: the attention mass each key of each probed request receives."""
        runner = self.runner()
        if runner is None:
            return
        req_ids = list(runner.input_batch.req_ids)
        if not any(r in self.active for r in req_ids):
            return
        unreadable = _unsupported_metadata(meta, len(req_ids))
        starts = [] if unreadable else meta.query_start_loc.tolist()
        seq_lens = [] if unreadable else meta.seq_lens.tolist()
        for req_id, probe in self.active.items():
            if probe.error or req_id not in req_ids:
                continue
            if unreadable:
                probe.error = unreadable
                self._store(probe)
                continue
            i = req_ids.index(req_id)
            lo, hi, length = starts[i], starts[i + 1], seq_lens[i]
            first = length - (hi - lo)  # the prompt position of this step's first row
            start = max(probe.rows_from, first, probe.read_to)  # rows read before a preemption are not read twice
            if start >= length:
                continue
            why = _unsupported_attention(impl, self.max_model_len)
            if why:
                probe.error = why
                self._store(probe)
                continue
            nb = (length + self.block_size - 1) // self.block_size
            blocks = meta.block_table[i, :nb].tolist()
            keys = torch.cat([self.read_keys(kv_cache, b) for b in blocks])[:length].float()  # [L, kv_heads, d]
            q = query.view(query.shape[0], int(impl.num_heads), int(impl.head_size))[lo + start - first : hi].float()  # rotated
            mass = attention_mass(q, keys, float(impl.scale), start)
            probe.mass = mass if probe.mass is None else _add(probe.mass, mass)
            probe.rows += length - start
            probe.read_to = length
            self._store(probe)


def attention_mass(q: torch.Tensor, keys: torch.Tensor, scale: float, start: int) -> torch.Tensor:
    """Per key, the attention probability it receives, summed over heads and rows: `q` `[rows, heads, d]` the
    queries of prompt positions `start, start + 1, ...`, `keys` `[positions, kv_heads, d]` every key of the prompt
    up to the last row (grouped-query heads share theirs); each row attends to the keys at or before its position.
    Rows go a chunk at a time, so that the logits stay near `CHUNK_ELEMENTS` values however long the prompt."""
    length, kv_heads = keys.shape[0], keys.shape[1]
    rows, heads, d = q.shape
    grouped = q.view(rows, kv_heads, heads // kv_heads, d)
    chunk = max(1, CHUNK_ELEMENTS // max(1, heads * length))
    keys_at = torch.arange(length).view(1, 1, 1, -1)
    total = torch.zeros(length, dtype=torch.float64)
    for lo in range(0, rows, chunk):
        part = grouped[lo : lo + chunk]
        logits = torch.einsum("rkgd,lkd->kgrl", part, keys) * scale  # [kv_heads, group, rows, keys]
        at = torch.arange(start + lo, start + lo + part.shape[0]).view(1, 1, -1, 1)
        logits.masked_fill_(keys_at > at, float("-inf"))
        total += torch.softmax(logits, dim=-1).sum(dim=(0, 1, 2)).double()
    return total


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two per-token sums of different lengths (a chunked prompt's steps), added where both have keys."""
    if a.numel() < b.numel():
        a, b = b, a
    out = a.clone()
    out[: b.numel()] += b
    return out


def _unsupported_attention(impl: Any, max_model_len: int = 0) -> str:
    if getattr(impl, "is_fp8_kv_cache", False):
        return "the probe layer's KV cache is quantized"
    if getattr(impl, "alibi_slopes", None) is not None:
        return "the probe layer uses ALiBi"
    if getattr(impl, "logits_soft_cap", None):
        return "the probe layer soft-caps its logits"
    if getattr(impl, "sinks", None) is not None:
        return "the probe layer has attention sinks"
    window = getattr(impl, "sliding_window", None)
    if isinstance(window, int) and 0 < window < max_model_len:  # a window over the whole context is full attention
        return "the probe layer has a sliding window shorter than the context"
    return ""


def probes_for(runner: Any, kv_caches: list[torch.Tensor], layer_names: list[str], relocator: Any, block_size: int) -> Probes:
    """The probes of one runner: the middle attention layer, read through the relocator's CPU K layout (the
    layout the start-up self-check confirmed); not readable where keys sit in another layout (a GPU backend)."""
    named = [n for n in layer_names if n]
    middle = named[len(named) // 2] if named else ""
    layout = getattr(relocator, "layout", None)
    if layout is None and hasattr(relocator, "relocators"):
        layout = getattr(relocator.relocators[0], "layout", None)
    limit = int(getattr(getattr(runner, "model_config", None), "max_model_len", 0) or 0)
    ref = _hold(runner)
    if layout is None or not kv_caches or kv_caches[0].device.type != "cpu":
        return Probes(ref, None, middle, block_size, unsupported="the attention probe reads vLLM's CPU KV cache only")
    if not middle:
        return Probes(ref, None, middle, block_size, unsupported="no attention layer name found for the probe")
    from spanq_backend.vllm_integration.kv_layout import read_keys

    return Probes(ref, lambda kv, b: read_keys(kv, layout, b), middle, block_size, max_model_len=limit)
