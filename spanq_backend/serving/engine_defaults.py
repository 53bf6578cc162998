"""The defaults of every engine spanq starts: the embedded `SpanEngine` (`EngineConfig`) and `spanq serve`.

One table, read by both, so the two kinds of engine are built alike: the same block size, context length and
prefix caching everywhere, and the settings that suit a CPU (float32, no torch.compile warm-up, a KV cache of its
own size instead of vLLM's share of the machine's memory) only on a CPU. On a GPU an engine keeps vLLM's own
choices there: the model's dtype, compiled graphs, `gpu_memory_utilization`.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "CPU_ENGINE_DEFAULTS", "DEFAULT_KV_CACHE_GIB", "ENGINE_DEFAULTS", "cpu_env_defaults", "on_cpu", "platform_defaults",
]

DEFAULT_KV_CACHE_GIB = 1.0  # a CPU engine's KV cache, where nothing else says (vLLM's CPU default is most of RAM)

# Every engine, every platform (vLLM's `EngineArgs` names).
ENGINE_DEFAULTS: dict[str, Any] = {
    "model": "default",
    "block_size": 32,
    "enable_prefix_caching": True,  # span KV reuse lives in the prefix cache
    "max_model_len": 4096,
}

# On a CPU only.
CPU_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,  # no torch.compile warm-up: starts in seconds on CPU
    "kv_cache_memory_bytes": int(DEFAULT_KV_CACHE_GIB * (1 << 30)),
}


def on_cpu() -> bool:
    """Whether vLLM runs on a CPU here (its platform, as vLLM itself decides it)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def platform_defaults(cpu: bool | None = None) -> dict[str, Any]:
    """`ENGINE_DEFAULTS` plus, on a CPU (`cpu`; None: this machine), `CPU_ENGINE_DEFAULTS`."""
    return {**ENGINE_DEFAULTS, **(CPU_ENGINE_DEFAULTS if (on_cpu() if cpu is None else cpu) else {})}


def cpu_env_defaults() -> None:
    """vLLM's CPU settings that suit an engine embedded in a user's process, where the user left them unset:
    the engine core in this process (for `spanq serve`, whose engine core is a process of its own: the model runner
    in that process), every core bound. vLLM reads them only from the environment; they are set
    when an engine starts, never on import. (The KV cache's size is each engine's own: `EngineConfig`.)"""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, (os.cpu_count() or 1) - 1)}")
