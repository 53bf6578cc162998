"""Running the project's examples from tests: scripts imported as modules, notebooks executed in a kernel (in a
process of their own, started ahead of their tests where the test module asks: `start_notebook`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

from tests import ahead

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


def run_notebook(relative: str, **env: str) -> str:
    """Execute a notebook (a path relative to the repository root) as a user runs it, in a kernel of this
    interpreter (found first by Jupyter: works on a fresh machine with no kernels installed), in a process of its
    own with `env` added to the environment; returns the text of its code cells' outputs. The run started ahead
    under the same arguments (`start_notebook`) when there is one. A failing cell fails the test with the cell
    and its traceback."""
    pytest.importorskip("ipykernel")
    returncode, outputs, errors = ahead.result(_key(relative, env), lambda: _execute(relative, env))
    if returncode != 0:
        pytest.fail(f"{relative} failed ({returncode}):\n{errors[-6000:]}")
    return outputs


def start_notebook(relative: str, **env: str) -> None:
    """Queue the notebook's run in the background (tests/ahead.py), for `run_notebook` with the same arguments."""
    if importlib.util.find_spec("ipykernel") is not None:
        ahead.submit(_key(relative, env), lambda: _execute(relative, env, in_background=True))


def _key(relative: str, env: dict[str, str]) -> tuple:
    return ("notebook", relative, tuple(sorted(env.items())))


def _execute(relative: str, env: dict[str, str], in_background: bool = False) -> tuple[int, str, str]:
    with tempfile.TemporaryDirectory(prefix="spanq-notebook-") as work:
        outputs = Path(work) / "outputs.txt"
        environment = {
            **os.environ, "JUPYTER_PATH": str(Path(work) / "jupyter"), "JUPYTER_RUNTIME_DIR": str(Path(work) / "runtime"),
            "PYDEVD_DISABLE_FILE_VALIDATION": "1", **env,
        }  # fmt: skip
        command = [sys.executable, "-m", "tests.examples", relative, str(outputs)]
        done = subprocess.run(
            ahead.in_background(command) if in_background else command,
            cwd=ROOT, env=environment, capture_output=True, text=True, timeout=1200, check=False,
        )  # fmt: skip
        return done.returncode, outputs.read_text() if outputs.exists() else "", done.stdout + done.stderr


def _main(relative: str, outputs: str) -> int:
    """The notebook's process: its kernel spec where JUPYTER_PATH says, the notebook run, its outputs written."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    spec_dir = Path(os.environ["JUPYTER_PATH"]) / "kernels" / KERNEL_NAME
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
    path = ROOT / relative
    notebook = nbformat.read(path, as_version=4)
    try:
        NotebookClient(
            notebook, kernel_name=KERNEL_NAME, timeout=900, resources={"metadata": {"path": str(path.parent)}}
        ).execute()
    except CellExecutionError as e:
        print(e, file=sys.stderr)
        return 1
    Path(outputs).write_text(
        "\n".join(
            out.get("text", "")
            for cell in notebook.cells
            if cell.cell_type == "code"
            for out in cell.get("outputs", [])
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:]))
