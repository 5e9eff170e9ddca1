"""The house's layers, checked with import-linter (its contracts are in .importlinter at the repository root).

import-linter reads a package from the file system under its import name, and our subpackages are folders
mapped by pyproject (`neuronfleet.operator` is `operator/`), so the sources are laid out as installed first.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

from support import ROOT

CONTRACTS = ROOT / ".importlinter"
FOLDERS = {  # folder in the repository -> where it is installed
    "neuronfleet": "neuronfleet",
    "operator": "neuronfleet/operator",
    "runtime": "neuronfleet/runtime",
    "localcluster": "neuronfleet/localcluster",
}


def installed_layout(into: Path) -> Path:
    for folder, target in FOLDERS.items():
        shutil.copytree(ROOT / folder, into / target, ignore=shutil.ignore_patterns("__pycache__"))
    return into


def lint_imports(layout: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).parent / "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(layout)}
    command = [str(lint), "--config", str(CONTRACTS), "--no-cache"]
    return subprocess.run(command, cwd=layout, env=env, capture_output=True, text=True)


def test_the_import_contracts_hold(tmp_path):
    run = lint_imports(installed_layout(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_a_broken_layer_is_caught(tmp_path):
    """The check can fail: an operator module that imports the runtime breaks its contract."""
    layout = installed_layout(tmp_path)
    topology = layout / "neuronfleet" / "operator" / "topology.py"
    topology.write_text(topology.read_text() + "\nfrom neuronfleet.runtime.engine import scheduler  # noqa\n")
    run = lint_imports(layout)
    assert run.returncode != 0
    assert "neuronfleet.operator.topology -> neuronfleet.runtime.engine.scheduler" in run.stdout


def test_no_test_module_imports_another():
    """Tests share helpers through tests/support.py (and the fault proxy tests/kv_faults.py), never through
    each other."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(ROOT)}: {n}"
                for n in names
                if n.split(".")[0].startswith(("test_", "conftest"))
            ]
    assert not offenders, offenders
