"""A model source that cannot be read stops an external engine's compile with the termination message the
operator retries on (contract.SOURCE_UNAVAILABLE): a `pvc://` or `file://` path that is not there
(compile.sh's check, before anything runs), and a Hub download that fails (the engines' download steps,
run here with huggingface_hub offline, so the Hub cannot answer)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from support import ROOT

from neuronfleet.contract import CACHE_MOUNT, SOURCE_UNAVAILABLE, TERMINATION_LOG_ENV
from neuronfleet.operator import builders
from neuronfleet.operator.spec import NeuronModelSpec

SAMPLES = {
    "vllm": "llama-3.1-8b-vllm-inf2.yaml",  # the plugin over NxD Inference
    "vllm-trn2": "llama-3.3-70b-vllm-trn2.yaml",  # the vLLM Neuron plugin
    "tgi": "llama-3.2-3b-tgi-inf2.yaml",
}


def config_files(engine: str, uri: str) -> dict[str, str]:
    spec = yaml.safe_load((ROOT / "crds" / "samples" / SAMPLES[engine]).read_text())["spec"]
    spec["model"]["uri"] = uri
    objects = builders.build_all(builders.Owner("m", "ns"), NeuronModelSpec.model_validate(spec))
    return next(o for o in objects if o["kind"] == "ConfigMap")["data"]


@pytest.mark.parametrize("engine", sorted(SAMPLES))
def test_a_missing_model_path_stops_the_compile_saying_so_before_it_runs(tmp_path, engine):
    script = config_files(engine, "pvc://models/nowhere/model")["compile.sh"]
    script = script.replace(CACHE_MOUNT, str(tmp_path / "cache"))
    log = tmp_path / "termination-log"
    env = {"PATH": "/usr/bin:/bin", TERMINATION_LOG_ENV: str(log)}
    run = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    message = log.read_text().strip()
    assert message.startswith(f"{SOURCE_UNAVAILABLE} pvc://models/nowhere/model: not found at "), message
    assert not list((tmp_path / "cache").rglob("manifest.json"))


@pytest.mark.parametrize("engine", ["tgi", "vllm-trn2"])
def test_a_hub_download_that_fails_says_the_source_is_unavailable(tmp_path, engine):
    """The download step of TGI's and the vLLM Neuron plugin's compile, as compile.sh runs it (model id,
    revision, folder)."""
    (tmp_path / "download.py").write_text(
        config_files(engine, "hf://nobody/no-such-model")["hub_download.py"]
    )
    log = tmp_path / "termination-log"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        TERMINATION_LOG_ENV: str(log),
    }
    command = [
        sys.executable,
        str(tmp_path / "download.py"),
        "nobody/no-such-model",
        "",
        str(tmp_path / "out"),
    ]
    run = subprocess.run(command, capture_output=True, text=True, env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    assert log.read_text().startswith(f"{SOURCE_UNAVAILABLE} hf://nobody/no-such-model: "), log.read_text()


def test_vllms_compile_says_the_hub_source_is_unavailable_before_loading(tmp_path):
    """vLLM's compile script; `vllm` itself (a multi-GB wheel) is replaced by a stand-in package whose LLM
    fails the test if the script ever reaches it after a failed download."""
    (tmp_path / "compile_vllm.py").write_text(
        config_files("vllm", "hf://nobody/no-such-model")["compile_vllm.py"]
    )
    standin = tmp_path / "standin" / "vllm"
    standin.mkdir(parents=True)
    (standin / "__init__.py").write_text(
        '"""Stand-in for the third-party vllm package."""\n\n\ndef LLM(**_):\n    raise SystemExit(3)\n'
    )
    log = tmp_path / "termination-log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           TERMINATION_LOG_ENV: str(log), "PYTHONPATH": str(tmp_path / "standin")}  # fmt: skip
    run = subprocess.run([sys.executable, "compile_vllm.py"], cwd=tmp_path, capture_output=True, text=True,
                         env=env)  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert log.read_text().startswith(f"{SOURCE_UNAVAILABLE} hf://nobody/no-such-model: "), log.read_text()
