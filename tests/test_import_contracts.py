"""The house's layers, checked with import-linter (its contracts are in .importlinter at the repository root).

import-linter reads a package from the file system under its import name, and our subpackages are folders
mapped by pyproject (`neuronfleet.operator` is `operator/`), so the sources are laid out as installed first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"neuronfleet": "neuronfleet", "operator": "neuronfleet/operator", "runtime": "neuronfleet/runtime",
            "localcluster": "neuronfleet/localcluster"}  # fmt: skip


def _installed_layout(into: Path) -> Path:
    for folder, target in PACKAGES.items():
        shutil.copytree(ROOT / folder, into / target, ignore=shutil.ignore_patterns("__pycache__"))
    return into


def lint_imports(tmp_path: Path, config: Path) -> subprocess.CompletedProcess:
    layout = _installed_layout(tmp_path / "src")
    env = {**os.environ, "PYTHONPATH": str(layout)}
    lint = Path(sys.executable).parent / "lint-imports"
    return subprocess.run(
        [str(lint), "--config", str(config), "--no-cache"], cwd=layout, env=env, capture_output=True, text=True
    )


def test_the_import_contracts_hold(tmp_path):
    run = lint_imports(tmp_path, ROOT / ".importlinter")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_a_broken_layer_is_caught(tmp_path):
    """The check can fail: an operator module that imports the runtime breaks its contract."""
    run_ok = tmp_path / "ok"
    layout = _installed_layout(run_ok / "src")
    bad = layout / "neuronfleet" / "operator" / "topology.py"
    bad.write_text(bad.read_text() + "\nfrom neuronfleet.runtime import scheduler  # noqa\n")
    env = {**os.environ, "PYTHONPATH": str(layout)}
    lint = Path(sys.executable).parent / "lint-imports"
    run = subprocess.run(
        [str(lint), "--config", str(ROOT / ".importlinter"), "--no-cache"],
        cwd=layout, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode != 0
    assert "neuronfleet.operator.topology -> neuronfleet.runtime.scheduler" in run.stdout
