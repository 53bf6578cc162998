"""spanq inside vLLM: the plugin's registration, every vLLM symbol it touches, and its patches grouped by the
vLLM process they run in. No fork: vLLM loads `register()` through the `vllm.general_plugins` entry point in
every process it starts (front end, engine core, workers).

| module | runs in | what |
|---|---|---|
| `engine_core` | the engine core (scheduler) | span block hashing, the start-up span check, isolation re-keying, CIDRA |
| `worker` | each worker (model runner) | key relocation before the forward pass; the worker's span status |
| `frontend` | the process that drives an engine | in-process engine shutdown; the `spanq serve` route |
| `support` | all | `SpanSupport`: does this engine honour span tables (invariant 9) |
| `symbols` | all | every vLLM symbol used, with the version it was written for, checked at registration |
| `counters` | worker, front end | the span runtime's counters of this process (`stats`), and the worker method that returns them |
| `kv_layout`, `cache_probe` | worker / front end | a loaded model's RoPE and K layout; is a span cached already |

`PATCHES` below is the whole list of what spanq changes in vLLM, each with why: `register()` applies the engine
core's and workers'; the front end's hold only while they are needed (`Patch.scoped`). Requests without a span
table keep stock behaviour (invariant 7). `SPANQ_DISABLE_PLUGIN=1` loads vLLM without any of it.
"""

from __future__ import annotations

import logging
import os

from spanq_backend.vllm_integration import attention_probe, engine_core, worker
from spanq_backend.vllm_integration.counters import stats, worker_span_stats
from spanq_backend.vllm_integration.frontend import FRONTEND_PATCHES
from spanq_backend.vllm_integration.patching import Patch
from spanq_backend.vllm_integration.support import (
    UNCHECKED,
    WORKER_STATS_METHOD,
    WORKER_STATUS_METHOD,
    SpanSupport,
    aquery_span_support,
    query_span_support,
)

__all__ = [
    "PATCHES",
    "UNCHECKED",
    "WORKER_STATS_METHOD",
    "WORKER_STATUS_METHOD",
    "Patch",
    "SpanSupport",
    "aquery_span_support",
    "query_span_support",
    "register",
    "stats",
]

log = logging.getLogger("spanq.vllm")


PATCHES: tuple[Patch, ...] = (
    Patch("engine core", "vllm.v1.engine.core", "get_request_block_hasher",
          "span blocks hash from their anchor, not from the prompt before them (EngineCore imports it by name)",
          wrap=engine_core.make_hasher_factory),
    Patch("engine core", "vllm.v1.engine.core", "EngineCore._initialize_kv_caches",
          "once the KV cache exists, ask every worker whether it moves keys; the hasher built next honours "
          "span tables only if all do", wrap=engine_core.wrap_initialize_kv_caches),
    Patch("engine core", "vllm.v1.core.kv_cache_manager", "KVCacheManager.get_computed_blocks",
          "spans that missed are re-keyed as context (isolation); CIDRA plans copies for blocks read elsewhere",
          wrap=engine_core.wrap_get_computed_blocks),
    Patch("engine core", "vllm.v1.core.single_type_kv_cache_manager",
          "FullAttentionManager.get_num_blocks_to_allocate",
          "CIDRA's copies count against capacity before a request is admitted",
          wrap=engine_core.wrap_get_num_blocks_to_allocate),
    Patch("engine core", "vllm.v1.core.single_type_kv_cache_manager", "FullAttentionManager.allocate_new_blocks",
          "CIDRA's copies are made through vLLM's copy-on-write; block positions are recorded",
          wrap=engine_core.wrap_allocate_new_blocks),
    Patch("worker", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model",
          "keys of blocks read at a new position are re-rotated before the forward pass (the CPU runner "
          "inherits this method: one hook for both)", wrap=worker.wrap_execute_model),
    Patch("worker", "vllm.v1.worker.gpu_model_runner", "copy_kv_cache_blocks_inplace",
          "a step's moves run after its block copies (the runner calls this module global)",
          wrap=worker.wrap_copy_blocks),
    Patch("worker", "vllm.v1.worker.worker_base", f"WorkerBase.{WORKER_STATUS_METHOD}",
          "the engine asks each worker, by name through collective_rpc, whether it moves keys",
          add=worker.worker_span_status),
    Patch("worker", "vllm.v1.worker.worker_base", f"WorkerBase.{WORKER_STATS_METHOD}",
          "`spanq serve` reads the span counters of the engine's processes (moves, relocation time, CIDRA "
          "duplicates) through collective_rpc, for its /metrics", add=worker_span_stats),
    Patch("worker", "vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.forward",
          "recompute=\"attention\": after the middle layer's attention, the probed requests' attention mass per "
          "key block is read (every other call is the stock one)", wrap=worker.wrap_cpu_attention_forward),
    Patch("worker", "vllm.v1.worker.worker_base", f"WorkerBase.{attention_probe.SCORES_METHOD}",
          "`spanq serve` takes an attention probe's result from the engine's process through collective_rpc",
          add=attention_probe.worker_attention_scores),
    *(Patch("engine core", "vllm.v1.engine.core", f"EngineCore.{name}",
            "`spanq serve` pins a corpus in the engine's KV cache (POST /v1/spans, DELETE /v1/spans/pin) through a utility call, which "
            "reaches an engine core method by name between two steps; the embedded engine calls the same pins",
            add=method)
      for name, method in ((engine_core.PIN_METHOD, engine_core.pin_blocks),
                           (engine_core.UNPIN_METHOD, engine_core.unpin_blocks),
                           (engine_core.PINNED_METHOD, engine_core.pinned_blocks))),
    *FRONTEND_PATCHES,  # scoped: applied where they are needed (frontend.py), not at registration
)

_registered = False


def _end_with_the_server() -> None:
    """In an engine core process (vLLM starts one per server), exit when the process that started it is gone,
    however it died: a killed `spanq serve` (a crashed cluster replica) must not leave an engine holding its
    memory. A daemon thread looks at the parent once a second; in an in-process engine nothing changes."""
    import multiprocessing
    import threading
    import time

    parent = multiprocessing.parent_process()
    if parent is None or not multiprocessing.current_process().name.startswith("EngineCore"):
        return

    def watch() -> None:
        while os.getppid() == parent.pid:
            time.sleep(1.0)
        log.warning("the server process %d is gone: this engine core exits", parent.pid)
        os._exit(1)

    threading.Thread(target=watch, name="spanq-parent-watch", daemon=True).start()


def register() -> None:
    """vLLM plugin entry point: apply `PATCHES` once per process (after checking every vLLM symbol)."""
    global _registered
    if _registered or os.environ.get("SPANQ_DISABLE_PLUGIN", "") not in ("", "0"):
        return
    from spanq_backend.vllm_integration import symbols

    symbols.check_symbols()
    for patch in PATCHES:
        if not patch.scoped:
            patch.apply()
    _end_with_the_server()
    _registered = True
    log.debug("spanq vLLM plugin registered (%d patches)", len(PATCHES))


