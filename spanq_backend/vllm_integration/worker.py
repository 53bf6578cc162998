"""The patches that run in vLLM's worker processes (the model runner), and the runner's span runtime.

- the CPU model runner's `execute_model` → before the forward pass, blocks whose keys encode another position
  are re-rotated (ReRoPE, invariant 2), tracked block by block (`SpanRuntime`);
- the runner's block-copy step (`copy_kv_cache_blocks_inplace`) → the moves of a step with block copies
  (CIDRA's duplicates) run right after the copies, before the forward pass;
- vLLM's `WorkerBase` gains `WORKER_STATUS_METHOD` (`worker_span_status`): whether this worker's runner
  moves keys for the loaded model, which the engine asks at start-up (invariant 9).

State: `runner_spans` (per model runner: its `SpanRuntime`, or why it has none).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from spanq_backend.vllm_integration.state import Extension
from spanq_backend.vllm_integration.support import STOCK, started_stock

__all__ = [
    "RunnerSpans",
    "SpanRuntime",
    "runner_span_status",
    "runner_spans",
    "runtime_of",
    "stepping_runtime",
    "worker_span_status",
    "wrap_copy_blocks",
    "wrap_cpu_attention_forward",
    "wrap_execute_model",
]

log = logging.getLogger("spanq.vllm")

HOOK_MARK = "__spanq_hook__"  # on the wrapped `execute_model`: what `runner_span_status` looks for


class SpanRuntime:
    """Per model runner: the block position tracker and the relocator over its KV caches."""

    def __init__(self, runner: Any):
        from spanq_backend.kv.relocation import BlockPositionTracker
        from spanq_backend.vllm_integration import kv_layout

        cfg = runner.cache_config
        self.block_size = int(cfg.block_size)
        kv_caches = [t for t in runner.kv_caches if t is not None]
        single_kv_cache_group(runner)
        windows_cover_the_context(runner)
        self.tracker = BlockPositionTracker(self.block_size, int(kv_caches[0].shape[0]) if kv_caches else 0)
        names = kv_layout.layer_names_of(runner, kv_caches)
        specs = kv_layout.rope_specs_of_layers(runner.get_model(), names)
        # Layers that share a RoPE (all of them, except in models like Gemma 3 with local and global bases) are
        # moved together. Keys written by the backend's own op, moved and read back on each group's cache: any
        # disagreement (a layout misread, a relocator wrong for this cache) refuses spans here instead of
        # serving wrong keys.
        groups: dict[int, tuple[Any, list[Any]]] = {}
        for kv, spec in zip(kv_caches, specs):
            groups.setdefault(id(spec), (spec, []))[1].append(kv)
        relocators = [kv_layout.checked_relocator(runner, caches, spec, self.block_size)
                      for spec, caches in groups.values()]
        self.relocator: Any = relocators[0] if len(relocators) == 1 else RelocatorGroup(relocators)
        from spanq_backend.vllm_integration.attention_probe import probes_for

        self.probes = probes_for(runner, kv_caches, names, self.relocator, self.block_size)  # recompute="attention"
        # Build or load the compiled op now, at start-up, not in the middle of the first step that moves keys.
        log.debug("keys move with %s", "a compiled op" if self.relocator.uses_compiled_kernel else "torch")
        self.pending: list[Any] = []
        self.relocation_seconds = 0.0  # host time in `relocator.apply` (spanq_relocation_seconds_total)

    def before_step(self, scheduler_output: Any) -> None:
        """Plan this step's moves; apply them now, or right after the step's block copies if it has any."""
        tracker, probes = self.tracker, self.probes
        for req_id in scheduler_output.finished_req_ids:
            tracker.finish(req_id)
            probes.finish(req_id)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            tracker.finish(req_id)  # its blocks were freed; it comes back as a resumed request
        copies = getattr(scheduler_output, "kv_cache_block_copies", None) or ()
        for c in copies:  # a copy's keys encode what its source's encode
            tracker.copied(c.src_block_id, c.dst_block_id)
        moves = []
        for req in scheduler_output.scheduled_new_reqs:
            moves += tracker.new_request(req.req_id, req.block_ids[0], req.num_computed_tokens)
            params = req.sampling_params
            if params is not None and params.extra_args:
                probes.start(req.req_id, params.extra_args)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                if new_blocks is not None:
                    moves += tracker.new_request(req_id, new_blocks[0], cached.num_computed_tokens[i])
            elif new_blocks is not None and new_blocks[0]:
                tracker.extend_request(req_id, new_blocks[0])
        self.pending = moves
        if not copies:
            self.flush()

    def flush(self) -> None:
        """Apply the planned moves (after this step's block copies, before its forward pass)."""
        moves, self.pending = self.pending, []
        if moves:
            started = time.perf_counter()
            self.relocator.apply(moves)
            self.relocation_seconds += time.perf_counter() - started


def single_kv_cache_group(runner: Any) -> None:
    """Refuse a KV cache split into groups (vLLM's hybrid KV cache manager: sliding-window layers apart from full
    ones). The scheduler then gives a request one block list per group, and layers of different groups share
    memory, so moving "block b" would move keys of layers that never read it. spanq starts sliding-window models
    with the hybrid manager off (one group); an engine started otherwise is refused here, not served wrong."""
    from spanq_backend.kv.rerope import RelocationError

    config = getattr(runner, "kv_cache_config", None)
    groups = list(getattr(config, "kv_cache_groups", None) or [])
    if len(groups) > 1:
        kinds = ", ".join(sorted({type(g.kv_cache_spec).__name__ for g in groups}))
        raise RelocationError(
            f"the KV cache is split into {len(groups)} groups ({kinds}); spanq moves the keys of one group only: "
            "start vLLM with --disable-hybrid-kv-cache-manager (spanq does for the models it starts)"
        )


def windows_cover_the_context(runner: Any) -> None:
    """Refuse sliding-window layers whose window is shorter than the engine's context. Where every window covers
    `max_model_len`, a sliding-window layer attends as a full one to every request the engine takes, and spans are
    exact as on any other layer (checked against the HF reference on Gemma 2 and 3). Shorter windows would make a
    span's keys depend on how far it sits from what reads it; spanq does not claim those exact."""
    from spanq_backend.kv.rerope import RelocationError

    limit = int(getattr(getattr(runner, "model_config", None), "max_model_len", 0) or 0)
    context = getattr(getattr(runner, "compilation_config", None), "static_forward_context", None) or {}
    windows = {int(w) for w in (getattr(layer, "sliding_window", None) for layer in context.values())
               if isinstance(w, int) and w > 0}
    if windows and limit and min(windows) < limit:
        raise RelocationError(
            f"sliding-window attention with a {min(windows)}-token window is shorter than the engine's context "
            f"({limit} tokens); spans are exact only where every window covers the context: start the engine "
            f"with max_model_len <= {min(windows)} for span reuse"
        )


class RelocatorGroup:
    """Several relocators (one per RoPE, over the layers that use it) applied as one."""

    def __init__(self, relocators: list[Any]):
        self.relocators = relocators

    @property
    def uses_compiled_kernel(self) -> bool:
        return any(r.uses_compiled_kernel for r in self.relocators)

    @property
    def moved_blocks(self) -> int:  # blocks, not blocks x relocators: every relocator moves the same blocks
        return self.relocators[0].moved_blocks

    def apply(self, moves: Any) -> None:
        for r in self.relocators:
            r.apply(moves)


@dataclass
class RunnerSpans:
    """One model runner's span runtime, or why it has none."""

    runtime: SpanRuntime | None
    refusal: str = ""


def _start_runtime(runner: Any) -> RunnerSpans:
    if started_stock(getattr(runner, "vllm_config", None)):  # no self-check, no hooks at work: a stock engine
        return RunnerSpans(None, STOCK.reason)
    try:
        return RunnerSpans(SpanRuntime(runner))
    except Exception as e:  # noqa: BLE001  (a runtime that cannot start means: no spans on this engine)
        log.warning("span reuse is off for this engine: %s", e)
        return RunnerSpans(None, f"keys cannot be moved for this model: {e}")


runner_spans: Extension[RunnerSpans] = Extension("vllm.v1.worker.gpu_model_runner.GPUModelRunner", _start_runtime)


def runtime_of(runner: Any) -> SpanRuntime | None:
    """The runner's span runtime, started on first use; None where keys cannot be moved (the engine then
    serves stock requests only: its span tables are ignored, see `support`)."""
    return runner_spans(runner).runtime


def runner_span_status(runner: Any) -> tuple[bool, str]:
    """`(True, "")` when this model runner moves span keys for its model, else `(False, why)`."""
    if runner is None:
        return False, "the worker has no model runner"
    if not getattr(getattr(type(runner), "execute_model", None), HOOK_MARK, False):
        return False, (
            f"{type(runner).__name__} is not hooked by spanq, so cached keys would never be moved "
            "(spanq hooks vLLM's GPUModelRunner and the runners that inherit its execute_model, CPU's included)"
        )
    if not getattr(runner, "kv_caches", None):
        return False, "the KV cache is not allocated"
    state = runner_spans(runner)
    return (True, "") if state.runtime is not None else (False, state.refusal)


def worker_span_status(worker: Any) -> tuple[bool, str]:
    """Installed on vLLM's `WorkerBase` as `support.WORKER_STATUS_METHOD`."""
    try:
        return runner_span_status(getattr(worker, "model_runner", None))
    except Exception as e:  # noqa: BLE001  (any failure means: no spans here)
        return False, f"checking the model runner failed: {type(e).__name__}: {e}"


# The runtime whose step is between its block copies and its forward pass, per thread (in-process engines
# step on threads of their own).
_stepping = threading.local()


def stepping_runtime() -> SpanRuntime | None:
    """The span runtime of the step this thread is in (between `execute_model`'s start and end), if any: what a
    KV connector called inside the step (spanq's tier) tells about the blocks it fills."""
    return getattr(_stepping, "runtime", None)


def wrap_execute_model(orig: Any) -> Any:
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "kv_caches", None):
            return orig(self, scheduler_output, *args, **kwargs)
        rt = runtime_of(self)
        if rt is None:
            return orig(self, scheduler_output, *args, **kwargs)
        rt.before_step(scheduler_output)
        _stepping.runtime = rt
        try:
            return orig(self, scheduler_output, *args, **kwargs)
        finally:
            _stepping.runtime = None
            rt.flush()  # only if the step had copies but never ran them (nothing else is pending)

    setattr(execute_model, HOOK_MARK, True)
    return execute_model


def wrap_copy_blocks(orig: Any) -> Any:
    def copy_kv_cache_blocks_inplace(*args: Any, **kwargs: Any) -> Any:
        result = orig(*args, **kwargs)
        rt = getattr(_stepping, "runtime", None)
        if rt is not None:
            rt.flush()
        return result

    return copy_kv_cache_blocks_inplace


def wrap_cpu_attention_forward(orig: Any) -> Any:
    """After vLLM's CPU attention of the probe layer, the probed requests' attention mass is read
    (`attention_probe.Probes.read`, recompute="attention"); every other call is the stock one."""

    def forward(self: Any, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any, attn_metadata: Any,
                output: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        rt = getattr(_stepping, "runtime", None)
        if rt is not None and attn_metadata is not None:
            probes = rt.probes
            if probes.active and getattr(layer, "layer_name", None) == probes.layer_name:
                probes.read(self, query, kv_cache, attn_metadata)
        return out

    return forward
