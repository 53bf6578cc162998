"""The layers of docs/architecture.md hold: imports go one way (import-linter's contracts in pyproject.toml),
and the repository stands on its own (nothing cites a file outside it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], check=False, cwd=root, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )


def test_imports_follow_the_layers():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "broken" in done.stdout and " 0 broken" in done.stdout


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    copy.mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", copy)
    for package in ("spanq_integrations", "spanq_backend", "benchmarks"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    return copy


def test_an_import_against_the_layers_is_caught(tmp_path):
    """The check can fail: the query language importing the runtime, the KV machinery importing vLLM, the
    client side importing the server side, a function-local import that closes a circle between two sibling
    modules (model folders <- models) — each breaks a contract."""
    for module, line, contract in [
        ("spanq_integrations/query/ir.py", "import spanq_integrations.runtime.executor", "Client side"),
        ("spanq_backend/kv/rerope.py", "import vllm.config", "The KV machinery is plain torch"),
        ("spanq_integrations/backends/resolve.py", "import spanq_backend.serving.embedded", "by name only"),
        ("spanq_backend/serving/model_folders.py", "def _later():\n    import spanq_backend.serving.models",
         "No import cycle"),
    ]:
        copy = _copy(tmp_path / contract.split()[0])
        target = copy / module
        target.write_text(target.read_text() + f"\n{line}  # noqa\n")
        done = lint_imports(copy)
        assert done.returncode != 0, f"{line} in {module} was not caught"
        assert contract in done.stdout and "BROKEN" in done.stdout


def imports_of_a_package_above(root: Path) -> list[str]:
    """Imports, function-local ones included, by which a module reaches a package it belongs to (its
    `__init__`'s namespace: `from spanq_backend import vllm_integration` in `vllm_integration/worker.py`). The
    package imports its modules, so each is a circle that import-linter's sibling contract does not see (parent and
    child are not siblings)."""
    import ast

    def exists(dotted: str) -> bool:
        path = root.joinpath(*dotted.split("."))
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    found = []
    for top in ("spanq_integrations", "spanq_backend"):
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            above = {".".join(parts[:i]) for i in range(1, len(parts))}
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    targets = [f"{node.module}.{a.name}" if exists(f"{node.module}.{a.name}") else node.module
                               for a in node.names]  # fmt: skip
                else:
                    continue
                found += [f"{path.relative_to(root)}:{node.lineno} imports {t}" for t in targets if t in above]
    return found


def test_no_module_imports_a_package_it_belongs_to():
    """#32: `vllm_integration/worker.py` imported its own package to read the span counters (now in
    `vllm_integration/counters.py`). The check can fail: that import, put back in a copy, is caught."""
    assert imports_of_a_package_above(ROOT) == []


def test_an_import_of_a_package_above_is_caught(tmp_path):
    copy = _copy(tmp_path)
    worker = copy / "spanq_backend" / "vllm_integration" / "worker.py"
    worker.write_text(worker.read_text() + "\n\ndef _later():\n    from spanq_backend import vllm_integration\n")
    found = imports_of_a_package_above(copy)
    assert len(found) == 1 and "worker.py" in found[0] and found[0].endswith("imports spanq_backend.vllm_integration")


def test_nothing_cites_a_file_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    outside = ("DESIGN.md", "ENVIRONMENT.md", "STYLE.md", "shared/")
    found = []
    for name in tracked:
        path = ROOT / name
        if name == "tests/test_architecture.py" or path.suffix not in {".py", ".md", ".ipynb", ".toml", ".sh", ""}:
            continue
        text = path.read_text(errors="replace") if path.is_file() else ""
        found += [f"{name}: {word}" for word in outside if word in text]
    assert not found, found


def test_every_test_the_design_cites_exists():
    """docs/design.md names the tests that check each invariant; a renamed or deleted test must update it."""
    import ast
    import re

    cited = set(re.findall(r"(tests/[\w/]+\.py)::(\w+)", (ROOT / "docs" / "design.md").read_text()))
    assert len(cited) > 20
    missing = []
    for path, name in sorted(cited):
        source = ROOT / path
        names = {
            n.name for n in ast.walk(ast.parse(source.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        } if source.is_file() else set()
        if name not in names:
            missing.append(f"{path}::{name}")
    assert not missing, missing
