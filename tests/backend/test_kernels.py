"""spanq's compiled CPU op, built for other CPUs than this one's best: the same results as the torch passes.

The default build uses what this CPU has (here AVX-512 BF16 for bfloat16 narrowing); machines without it get the
AVX2 path or plain C++. `SPANQ_KERNEL_ISA` caps the build, so each path is compiled and checked here, in a
subprocess (a process loads one build of the op), for every cache dtype, both K layouts and both RoPE styles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHECK = r"""
import json, sys, torch
from spanq_backend.kv import kernels
from spanq_backend.kv.relocation import KLayout, KVRelocator, Move
from spanq_backend.kv.rerope import RopeSpec

torch.manual_seed(0)
bs, hd, heads, nb = 32, 64, 2, 9
moves = [Move(1, 40), Move(3, -7), Move(4, 1000), Move(8, -2000)]
out = {"cflags": kernels._cflags(), "cases": []}
cases = [(d, l, n, r) for d in (torch.float32, torch.bfloat16, torch.float16)
         for l in (KLayout.row_major(bs, hd), KLayout.transposed(bs, hd)) for n in (True, False) for r in (hd, hd // 2)]
for dtype, layout, neox, rot in cases:  # rot < hd: partial rotary, the last dims stay as they are
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))  # (float64: see test_relocation.plain_spec)
    angles = torch.arange(4096, dtype=torch.float64)[:, None] * inv[None]
    spec = RopeSpec.from_cos_sin_cache(torch.cat([angles.cos(), angles.sin()], -1).float(), rot, hd, neox)
    base = [torch.randn(nb, heads, bs, 2 * hd).to(dtype) for _ in range(3)]
    base[0][4, 0, 0, 0] = float("nan")
    fast, slow = [t.clone() for t in base], [t.clone() for t in base]
    compiled = KVRelocator(fast, layout, spec)
    compiled.apply(moves)
    KVRelocator(slow, layout, spec, compiled=False).apply(moves)
    a = torch.cat([t.float().flatten() for t in fast])
    b = torch.cat([t.float().flatten() for t in slow])
    same_nan = bool(torch.equal(a.isnan(), b.isnan()))
    ok = ~a.isnan()
    out["cases"].append({
        "dtype": str(dtype), "layout": layout.kind, "neox": neox, "rotary_dim": rot,
        "compiled": compiled.uses_compiled_kernel,
        "max_diff": float((a[ok] - b[ok]).abs().max()), "same_nan": same_nan,
        "nan_kept": bool(a.isnan().any()),
    })
print(json.dumps(out))
"""


def run_check(isa: str) -> dict:
    env = {**os.environ, "SPANQ_KERNEL_ISA": isa}
    env.pop("SPANQ_NO_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", CHECK], check=False, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("isa, must_have, must_lack", [
    ("native", [], []),
    ("avx2", ["-mavx2"], ["-mavx512bf16"]),
    ("generic", [], ["-mavx2", "-mavx512bf16"]),
])
def test_capped_builds_match_the_torch_passes(isa, must_have, must_lack):
    out = run_check(isa)
    for flag in must_have:
        assert flag in out["cflags"], out["cflags"]
    for flag in must_lack:
        assert flag not in out["cflags"], out["cflags"]
    for case in out["cases"]:
        assert case["compiled"], case
        tol = 1e-5 if case["dtype"] == "torch.float32" else 2e-2
        assert case["max_diff"] <= tol, case
        assert case["same_nan"] and case["nan_kept"], case


def test_an_unknown_isa_falls_back_to_torch_with_the_reason():
    env = {**os.environ, "SPANQ_KERNEL_ISA": "sse9"}
    code = "from spanq_backend.kv import kernels; print(kernels.relocate_keys_op()); kernels.relocate_keys_op(required=True)"
    proc = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stdout.strip().splitlines()[0] == "None"
    assert "SPANQ_KERNEL_ISA='sse9'" in proc.stderr
