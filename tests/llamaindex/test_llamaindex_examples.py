"""The LlamaIndex examples run: the scripts on the session's tiny engine, the notebook as a user runs it (its own
kernel, the embedded default model)."""

from __future__ import annotations

import pytest

from tests.examples import load_example

pytestmark = pytest.mark.vllm


def test_rag_script(tiny_backend, capsys):
    rows = load_example("examples/rag/llamaindex_rag.py").main(
        ["--max-tokens", "4", "--top-k", "3"], tiny_backend
    )
    by_name = [r["synthesizer"] for r in rows]
    assert by_name == ["spans", "spans", "tree k=2", "compact", "compact"]
    assert rows[2]["calls"] == 2  # 3 nodes, k=2
    assert all(r["calls"] == 1 for r in rows if r["synthesizer"] != "tree k=2")
    out = capsys.readouterr().out
    assert "With spans, Q2 shared" in out and "compact synthesizer" in out


def test_judge_scripts(tiny_backend, capsys):
    summary = load_example("examples/judge/llamaindex_judge_agreement.py").main(
        ["--pairs", "2", "--consensus-max-tokens", "4"], tiny_backend
    )
    assert summary["pairs"] == 2 and summary["totals"]["spans"]["calls"] == 2
    assert 2 <= summary["totals"]["consensus"]["calls"] <= 4  # the swapped call only follows a valid verdict
    assert "span judge vs strict consensus" in capsys.readouterr().out

    results = load_example("examples/judge/llamaindex_judge.py").main([], tiny_backend)
    assert results["forward"].response == results["swapped"].response
    assert results["best"].usage["calls"] == 3  # 4 candidates, k=2


@pytest.mark.slow
def test_notebook_runs_on_the_embedded_default(notebook_kernel):
    outputs = notebook_kernel.run("examples/rag/llamaindex_rag.ipynb")
    assert "shared documents:" in outputs and "cached tokens:" in outputs
    assert "spans computed for this question: 0 of 3" in outputs  # the same nodes reordered: all cached
    assert "$.g.input.cross[1].plus[0]" in outputs  # the tree's first leaf
