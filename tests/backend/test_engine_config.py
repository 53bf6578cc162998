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
