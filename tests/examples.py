"""Running the project's examples from tests: scripts imported as modules, notebooks executed in a kernel shared
by the session's notebooks."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

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


class NotebookKernel:
    """One Jupyter kernel of this interpreter, started for the session's first notebook and kept for the others,
    so that the embedded default engine, the imports and the kernel start are paid once a run, not once a notebook
    (the session fixture `notebook_kernel`). Each notebook runs as in a fresh kernel of its own, as far as it can
    see: its namespace is cleared first (`%reset -f`), it runs in its own folder with that folder first on
    `sys.path` and the environment it is given, and afterwards the folder, the modules imported from it and that
    environment go again. What it shares with the notebooks before it is the process: modules imported from
    elsewhere and the shared embedded engine, whose span cache holds their documents (the three notebooks read
    different texts: the LangChain RAG notebook its own four, the agent the raw `documents.json`, LlamaIndex the
    same with each node's metadata in front)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.km: Any = None

    def run(self, relative: str, **env: str) -> str:
        """Execute a notebook; returns the text of its code cells' outputs. A failing cell raises nbclient's
        CellExecutionError, with the cell and its traceback."""
        pytest.importorskip("ipykernel")
        import nbformat
        from nbclient import NotebookClient

        path = ROOT / relative
        notebook = nbformat.read(path, as_version=4)
        here = str(path.parent)
        enter = nbformat.v4.new_code_cell(
            "%reset -f\n"
            "import os as _os, sys as _sys\n"
            f"_os.chdir({here!r}); _sys.path.insert(0, {here!r}); _os.environ.update({env!r})\n"
            "del _os, _sys"
        )
        leave = nbformat.v4.new_code_cell(
            "import os as _os, sys as _sys\n"
            f"_sys.path.remove({here!r})\n"
            f"for _k in {sorted(env)!r}: _os.environ.pop(_k, None)\n"
            "for _n, _m in list(_sys.modules.items()):\n"
            f"    if (getattr(_m, '__file__', None) or '').startswith({here + os.sep!r}): del _sys.modules[_n]\n"
            "del _os, _sys"
        )
        cells = notebook.cells
        notebook.cells = [enter, *cells, leave]
        if self.km is None:
            self.km = self._manager()
        # the first notebook starts the kernel (in the repository root); the client does not own it: it stays
        client = NotebookClient(notebook, km=self.km, timeout=900, resources={"metadata": {"path": str(ROOT)}})
        try:
            client.execute()
        finally:
            if client.kc is not None:
                client.kc.stop_channels()
        return "\n".join(
            out.get("text", "") for cell in cells if cell.cell_type == "code" for out in cell.get("outputs", [])
        )

    def _manager(self) -> Any:
        """The manager of a kernel of this interpreter (its own kernel spec: works on a fresh machine with no
        kernels installed)."""
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import AsyncKernelManager

        spec_dir = self.folder / "kernels" / KERNEL_NAME
        spec_dir.mkdir(parents=True, exist_ok=True)
        (spec_dir / "kernel.json").write_text(
            json.dumps(
                {
                    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": "spanq tests",
                    "language": "python",
                    "env": {"PYDEVD_DISABLE_FILE_VALIDATION": "1"},
                }
            )
        )
        specs = KernelSpecManager(kernel_dirs=[str(self.folder / "kernels")])
        return AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs,
                                  connection_file=str(self.folder / "connection.json"))

    def close(self) -> None:
        if self.km is not None and self.km.has_kernel:
            from jupyter_core.utils import run_sync

            run_sync(self.km.shutdown_kernel)(now=True)
        self.km = None
