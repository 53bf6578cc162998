"""The LlamaIndex examples run: the scripts on the session's tiny engine, the notebook as a user runs it (its own
kernel, the embedded default model)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "rag" / "llamaindex_rag.ipynb"
KERNEL_NAME = "spanq-tests-python"

pytestmark = pytest.mark.vllm


def load_example(relative: str):
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


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


@pytest.fixture
def python_kernel(tmp_path, monkeypatch) -> str:
    """A kernelspec for this interpreter, found first by Jupyter: works on a fresh machine with no kernels."""
    pytest.importorskip("ipykernel")
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "spanq tests",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    return KERNEL_NAME


@pytest.mark.slow
def test_notebook_runs_on_the_embedded_default(python_kernel):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name=python_kernel,
        timeout=900,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
    outputs = "\n".join(
        out.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )
    assert "shared documents:" in outputs and "cached tokens:" in outputs
    assert "spans computed for this question: 0 of 3" in outputs  # the same nodes reordered: all cached
    assert "$.g.input.cross[1].plus[0]" in outputs  # the tree's first leaf
