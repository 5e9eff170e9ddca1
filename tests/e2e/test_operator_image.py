"""The operator runs with only the operator image's packages: `neuronfleet operator` imports no model code,
and a fresh environment holding exactly docker/operator-requirements.txt (what the Dockerfile's operator stage
installs) plus neuronfleet without its dependencies starts the operator against the emulated API server and
reconciles a NeuronModel.

The second test installs packages with pip (from the configured index; pip's cache makes repeats fast)."""

from __future__ import annotations

import fnmatch
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from support import ROOT

REQUIREMENTS = ROOT / "docker" / "operator-requirements.txt"
APISERVER_MODULE = "neuronfleet.localcluster.apiserver"  # run from the dev environment
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
SAMPLE = ROOT / "crds" / "samples" / "llama-3.1-8b-vllm-inf2.yaml"
MODEL_CODE = ("torch", "numpy", "xxhash", "safetensors", "tokenizers", "gguf", "neuronfleet.runtime")


def test_the_operator_command_imports_no_model_code():
    """What `neuronfleet operator` loads (the command line, then kopf's handlers), in a clean process."""
    probe = (
        "import sys; from neuronfleet import cli; cli.build_parser(); import neuronfleet.operator.handlers; "
        f"print([m for m in sys.modules if m.startswith({MODEL_CODE!r})])"
    )
    run = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def wait_for(what: str, check: Callable[[], object], alive: list[subprocess.Popen], logs: list[Path]):
    """Poll until `check` is truthy; fails at once, with the logs, when a process it depends on exits."""
    deadline = time.monotonic() + 300  # a ceiling for a very busy machine; normally seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        for proc, log in zip(alive, logs, strict=True):
            if proc.poll() is not None:
                raise AssertionError(
                    f"{log.name} exited ({proc.returncode}) before {what}:\n{log.read_text()}"
                )
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(p.read_text()[-3000:] for p in logs))


def build_context(dst: Path) -> Path:
    """The repository as `docker build` sees it (.dockerignore applied)."""
    ignored = [
        line.strip().removeprefix("**/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    shutil.copytree(ROOT, dst, ignore=lambda _, names: [n for n in names if any(
        fnmatch.fnmatch(n, pattern) for pattern in ignored)])  # fmt: skip
    return dst


@pytest.mark.installs_packages
@pytest.mark.skipif(not Path(KUBECTL).exists(), reason="kubectl is not installed")
def test_the_operator_starts_and_reconciles_with_only_the_operator_images_packages(tmp_path):
    fresh = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(fresh)], check=True, timeout=300)
    pip = [
        str(fresh / "bin" / "python"),
        "-P",
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
    ]
    source = build_context(tmp_path / "context")
    for args in (["-c", "constraints.txt", "-r", str(REQUIREMENTS.relative_to(ROOT))], ["--no-deps", "."]):
        run = subprocess.run([*pip, *args], cwd=source, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout + run.stderr
    absent = subprocess.run(
        [str(fresh / "bin" / "python"), "-c", "import importlib.util as u; print(u.find_spec('torch'))"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert absent.stdout.strip() == "None"  # the image's package set has no model code

    state = tmp_path / "cluster"
    state.mkdir()
    kubeconfig, logs = state / "kubeconfig", [state / "apiserver.log", state / "operator.log"]
    server = subprocess.Popen(
        [sys.executable, "-P", "-m", APISERVER_MODULE, "--kubeconfig", str(kubeconfig),
         "--ready-file", str(state / "url")],
        stdout=logs[0].open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    procs = [server]
    try:
        wait_for("the API server", lambda: (state / "url").exists(), procs, logs[:1])

        def kubectl(*args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
            cmd = [KUBECTL, "--kubeconfig", str(kubeconfig), "--cache-dir", str(state / "kubectl-cache")]
            run = subprocess.run([*cmd, *args], input=stdin, capture_output=True, text=True, timeout=120)
            assert run.returncode == 0 or not check, run.stderr
            return run

        kubectl("apply", "-f", str(ROOT / "crds" / "neuronfleet.dev_neuronmodels.yaml"))
        kubectl("apply", "-f", "-", stdin="apiVersion: v1\nkind: Namespace\nmetadata: {name: inference}\n")
        operator = [str(fresh / "bin" / "neuronfleet"), "operator", "--kubeconfig", str(kubeconfig)]
        procs.append(
            subprocess.Popen(
                [*operator, "--standalone", "--verbose"],
                cwd=tmp_path,
                stdout=logs[1].open("w"),
                stderr=subprocess.STDOUT,
            )
        )
        with_autoscaling = yaml.safe_load(SAMPLE.read_text())
        with_autoscaling["spec"]["autoscaling"] = {"enabled": True}
        kubectl("apply", "-f", "-", stdin=yaml.safe_dump(with_autoscaling))

        def validated() -> dict | None:
            run = kubectl("get", "nm", "llama-3-1-8b", "-n", "inference", "-o", "json", check=False)
            model = json.loads(run.stdout) if run.returncode == 0 else {}
            conditions = {c["type"]: c for c in (model.get("status") or {}).get("conditions") or []}
            return conditions if conditions.get("Validated", {}).get("status") == "True" else None

        conditions = wait_for("the model's status", validated, procs, logs)
        assert conditions["AutoscalingActive"]["reason"] == "Builtin"  # the manifest enables it
        jobs = json.loads(kubectl("get", "jobs", "-n", "inference", "-o", "json").stdout)["items"]
        assert [j["metadata"]["name"].split("-compile-")[0] for j in jobs] == ["llama-3-1-8b"]
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
