"""Running the project's examples from tests: scripts imported as modules, notebooks executed in a kernel."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_NAME = "spanq-tests-python"


def load_example(relative: str) -> ModuleType:
    """Import an example script (a path relative to the repository root) as a module."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(f"spanq_example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def run_notebook(relative: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    """Execute a notebook in a kernel of this interpreter (found first by Jupyter: works on a fresh machine
    with no kernels installed); returns the text of its code cells' outputs. A failing cell raises
    nbclient's CellExecutionError, with the cell and its traceback."""
    pytest.importorskip("ipykernel")
    import nbformat
    from nbclient import NotebookClient

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
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    path = ROOT / relative
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, kernel_name=KERNEL_NAME, timeout=900, resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    return "\n".join(
        out.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )
