"""How an embedded engine is built: settings that are each engine's own."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm


def _blocks(backend) -> int:
    return backend.engine.llm_engine.vllm_config.cache_config.num_gpu_blocks


def test_each_engine_in_a_process_gets_the_kv_cache_size_it_asks_for(tiny_model, monkeypatch):
    """Sizes are each engine's own, in fractions of a GiB too; vLLM's process-wide VLLM_CPU_KVCACHE_SPACE (set
    here as a user might) neither overrides an explicit size nor is changed by it."""
    from spanq_backend.serving.embedded import EmbeddedBackend

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    small = EmbeddedBackend(str(tiny_model), kv_cache_gib=0.25, max_model_len=1024, max_num_seqs=2)
    try:
        large = EmbeddedBackend(str(tiny_model), kv_cache_gib=0.5, max_model_len=1024, max_num_seqs=2)
        try:
            unset = EmbeddedBackend(str(tiny_model), max_model_len=1024, max_num_seqs=2)  # the user's 1 GiB
            try:
                assert _blocks(large) == pytest.approx(2 * _blocks(small), rel=0.01)
                assert _blocks(unset) == pytest.approx(4 * _blocks(small), rel=0.01)
            finally:
                unset.close()
        finally:
            large.close()
    finally:
        small.close()
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_a_kv_cache_size_that_is_not_positive_is_refused_before_an_engine_starts():
    from spanq_backend.serving.engine import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_gib must be a positive number of GiB, got 0"):
        EngineConfig(kv_cache_gib=0)


def test_one_table_of_defaults_and_the_cpu_settings_only_on_a_cpu(monkeypatch):
    """#32 item 6: the embedded engine and `spanq serve` read one table; float32, eager mode and a 1 GiB KV cache are
    a CPU's settings — on a GPU the embedded engine keeps vLLM's own (the model's dtype, compiled graphs,
    gpu_memory_utilization). An engine config that applied the CPU's everywhere (as until 2026-12-02) fails the
    second check."""
    from spanq_backend.serving.engine import EngineConfig
    from spanq_backend.serving.server import parse_serve_args

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    config = EngineConfig()
    assert config.engine_options(cpu=True) == {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 1 << 30}
    assert config.engine_options(cpu=False) == {"dtype": "auto", "enforce_eager": False, "kv_cache_memory_bytes": None}
    mine = EngineConfig(dtype="bfloat16", enforce_eager=True, kv_cache_gib=2)
    assert mine.engine_options(cpu=False) == {"dtype": "bfloat16", "enforce_eager": True, "kv_cache_memory_bytes": 2 << 30}
    served = parse_serve_args(["--model", "tiny"])  # on this machine (a CPU): the same engine as embedded
    here = config.engine_options()
    assert (served.block_size, served.max_model_len, served.enable_prefix_caching) == (config.block_size, config.max_model_len, True)
    assert (served.dtype, served.enforce_eager, served.kv_cache_memory_bytes) == (
        here["dtype"], here["enforce_eager"], here["kv_cache_memory_bytes"]
    )
