"""Quiet by default: the demo (an embedded engine) shows spanq's progress and vLLM's warnings only, and
SPANQ_LOG_LEVEL brings vLLM's INFO lines back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_INFO = re.compile(r"\bINFO\b .*\[[\w.]+\.py:\d+\]")  # vLLM's own format: "INFO 11-30 19:50:24 [core.py:402]"


def run_demo(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("SPANQ_LOG_LEVEL", "VLLM_LOGGING_LEVEL")}
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / "rag" / "demo.py"), "--model", "tiny", "--max-tokens", "4", *args],
        check=False, capture_output=True, text=True, timeout=600, cwd=REPO, env={**environment, **env},
    )  # fmt: skip


@pytest.mark.vllm
@pytest.mark.slow  # the demo in a process of its own: a vLLM import and two engine starts (~30 s)
def test_the_demo_fits_on_a_screen_and_shows_spanqs_progress():
    done = run_demo()
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    lines = out.splitlines()
    assert len(lines) <= 45, "\n".join(lines)  # was ~90, most of them vLLM INFO lines
    assert not [line for line in lines if VLLM_INFO.search(line)]
    # vLLM's note as it is imported, printed bare before any handler of its own, was the first line a user saw
    assert "Triton is installed, but doesn't include CPU backend" not in out, "\n".join(lines[:5])
    assert "spanq: starting a span-aware vLLM engine on tiny" in out
    assert re.search(r"spanq: tiny\S* ready in \d+\.\d s", out)
    # the stock engine beside it neither checks nor claims span reuse (it printed "span reuse is on" until 2026-12-03)
    assert "spanq: starting a stock vLLM engine on tiny" in out and out.count("span reuse is on") == 1
    # Q1's eight small new documents, by default read in context and prepared when idle: said in one line
    # (it named the call "$", its path in the query's JSON, until 2026-12-05)
    assert "spanq: read 8 new documents in context for the query; preparing them as spans when idle" in out
    assert "TTFT, spans vs stock: Q1" in out and "; Q3 " in out  # the table is there


@pytest.mark.vllm
@pytest.mark.slow
def test_spanq_log_level_brings_vllms_info_lines_back_and_a_bad_one_is_named():
    done = run_demo("--no-stock", SPANQ_LOG_LEVEL="INFO")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert [line for line in out.splitlines() if VLLM_INFO.search(line)]
    bad = run_demo("--no-stock", SPANQ_LOG_LEVEL="LOUD")
    assert bad.returncode != 0
    assert "SPANQ_LOG_LEVEL='LOUD' is not a log level: use one of DEBUG, INFO, WARNING, ERROR" in bad.stderr
