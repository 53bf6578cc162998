"""The LangChain examples run: the RAG script on the session's tiny engine, the notebook as a user runs it (its
own kernel, the embedded default model SmolLM2)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from spanq_integrations.langchain import ChatSpanQuery

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "rag" / "langchain_rag.ipynb"
KERNEL_NAME = "spanq-langchain-tests-python"

pytestmark = pytest.mark.vllm


def load_example(relative: str):
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(f"spanq_example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_rag_script_reuses_the_reordered_documents(tiny_backend):
    example = load_example("examples/rag/langchain_rag.py")
    llm = ChatSpanQuery(backend=tiny_backend, max_tokens=4, temperature=0)
    docs = example.load_documents(4)
    rows = example.run(llm, docs, k=4)
    assert [r["chain"] for r in rows] == ["unchanged"] * 2 + ["one line"] * 2 + ["drop-in"] * 2
    for first, second in zip(rows[::2], rows[1::2]):
        assert first["order"] != second["order"] and sorted(first["order"]) == sorted(second["order"])
        assert first["spans"] == second["spans"] == 4
        assert second["prepared"] == 0 and second["cached"] >= second["prompt"] // 2


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
    monkeypatch.setenv("SPANQ_EXAMPLE_MAX_TOKENS", "8")
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
    assert "4 spans, 0 computed now" in outputs  # the second question: every document from the span cache
    assert "from the span cache, with its 4 documents in a new order" in outputs
    assert "fallback: text other than whitespace" in outputs
