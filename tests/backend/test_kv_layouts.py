"""Keys move exactly in every KV cache layout vLLM 0.32 defines (`KVCacheLayout`), with the torch passes and
with the Triton kernel (run on CPU under Triton's interpreter), for fp32/bf16/fp16, NeoX and GPT-J rotary, and
partial rotary. The reference is `rerope_` on the logical view; V and blocks that did not move stay bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.backend.kv_layout_cases import DTYPES, LAYOUTS, ROPES, run

ROOT = Path(__file__).resolve().parents[2]
TOL = {"fp32": 1e-5, "bf16": 0.0, "fp16": 0.0}  # low precision: rounded once, from the same float32 result
# Under the interpreter, Triton converts float32 to bfloat16 by its own rounding (not torch's round-to-nearest):
# one bf16 ulp for these keys (|k| < 8). fp32 and fp16 come out exact.
TRITON_TOL = {**TOL, "bf16": 2.0**-5}


def test_the_layouts_are_vllms():
    vllm_layouts = pytest.importorskip("vllm.v1.kv_cache_layout")
    assert {m.name: m.value for m in vllm_layouts.KVCacheLayout} == LAYOUTS


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rope", list(ROPES))
def test_the_torch_passes_move_keys_in_every_layout(layout, dtype, rope):
    assert run(layout, DTYPES[dtype], rope, "torch") <= TOL[dtype]


def test_a_wrong_delta_is_caught():
    assert run("LBNHC", torch.float32, "neox", "torch", negate=True) > 1e-2


@pytest.fixture(scope="module")
def interpreted():
    """The Triton kernel on every case, under Triton's interpreter, in a process of its own."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.backend.kv_layout_cases"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_the_triton_kernel_moves_keys_in_every_layout_dtype_and_rotary_style(interpreted):
    cases = [c for c in interpreted if "layout" in c]
    assert len(cases) == len(LAYOUTS) * len(DTYPES) * len(ROPES)
    bad = [c for c in cases if not c["err"] <= TRITON_TOL[c["dtype"]]]
    assert not bad, bad


def test_the_triton_kernel_check_catches_a_wrong_delta(interpreted):
    (negated,) = [c["negated"] for c in interpreted if "negated" in c]
    assert negated > 1e-2
