"""`neuronfleet compile`: a model source into artifacts/<hash>/ (weights in the target dtype, validated by a
full load, tokenizer and config), manifest.json last, a cache hit at once, clear errors; and no cache hit on
what another model sharing the claim wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import make_tiny_llama

from neuronfleet.contract import CACHE_MOUNT, CONFIG_MOUNT, TERMINATION_LOG_ENV
from neuronfleet.localcluster.processes import map_path, mounted_folders, rewrite_command
from neuronfleet.operator import builders, validation
from neuronfleet.runtime.artifacts.compile_artifacts import CompileError, compile_artifacts
from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.model_runner import ModelRunner


def write_config(path, uri: str, **extra) -> None:
    config = {
        "compileHash": "abc123",
        "engine": "embedded",
        "instanceType": "cpu",
        "model": {"uri": uri, "revision": None},
        "dtype": "bfloat16",
        "sequenceLength": 64,
        "maxInputLength": 32,
        "batchSize": 2,
        "buckets": {"context": [16, 32], "generation": [64]},
        **extra,
    }
    path.write_text(json.dumps(config))


def test_compile_converts_validates_and_marks_complete_then_hits_the_cache(tmp_path):
    model = make_tiny_llama(tmp_path / "src")
    write_config(tmp_path / "compile.json", f"file://{model}")
    out = tmp_path / "cache" / "artifacts" / "abc123"
    manifest = compile_artifacts(tmp_path / "compile.json", out, log=lambda m: None)
    assert manifest["cacheHit"] is False and manifest["compileHash"] == "abc123" and manifest["bytes"] > 0
    assert json.loads((out / "manifest.json").read_text())["compileHash"] == "abc123"
    weights = load_file(str(next((out / "model").glob("*.safetensors"))))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert json.loads((out / "model" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ModelRunner(out / "model", RuntimeConfig(slots=1, max_seq_len=64, dtype="bfloat16"))  # as serving pods
    assert not list(out.parent.glob(".*partial*"))  # no staging left behind
    stamp = (out / "manifest.json").stat().st_mtime_ns
    again = compile_artifacts(tmp_path / "compile.json", out, log=lambda m: None)
    assert again["cacheHit"] is True and (out / "manifest.json").stat().st_mtime_ns == stamp


def test_the_command_line_runs_it_and_reports_a_cache_hit(tmp_path):
    model = make_tiny_llama(tmp_path / "src")
    write_config(tmp_path / "compile.json", f"file://{model}")
    out = tmp_path / "artifacts" / "abc123"
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "neuronfleet.cli",
        "compile",
        "--config",
        str(tmp_path / "compile.json"),
    ]
    first = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    second = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True)
    assert second.returncode == 0 and "cache hit" in second.stderr


@pytest.mark.parametrize(
    ("uri", "extra", "message"),
    [
        (
            "file:///nowhere/model",
            {},
            "model source unavailable: file:///nowhere/model: not found at /nowhere",
        ),
        ("gs://bucket/model", {}, "gs://bucket/model is not supported"),
        (
            "file:///tmp",
            {"instanceType": "inf2.xlarge"},
            "the embedded engine compiles for cpu, and for trn2 and trn3 with compiledSteps neuron",
        ),
        ("file:///tmp", {"instanceType": "trn2.48xlarge"}, "trn2.48xlarge with compiledSteps off"),
    ],
)
def test_bad_sources_and_targets_fail_clearly_and_leave_nothing(tmp_path, uri, extra, message):
    write_config(tmp_path / "compile.json", uri, **extra)
    out = tmp_path / "artifacts" / "abc123"
    with pytest.raises(CompileError, match=message):
        compile_artifacts(tmp_path / "compile.json", out, log=lambda m: None)
    assert not out.exists()
    assert not (out.parent.exists() and list(out.parent.glob(".*")))  # no staging folder left


def test_buckets_that_do_not_fit_the_lengths_are_refused(tmp_path):
    model = make_tiny_llama(tmp_path / "src")
    write_config(tmp_path / "compile.json", f"file://{model}", buckets={"context": [16], "generation": [32]})
    with pytest.raises(ValueError, match="largest decode bucket must equal max_seq_len"):
        compile_artifacts(tmp_path / "compile.json", tmp_path / "out", log=lambda m: None)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_from_elsewhere_replaces_the_models(tmp_path):
    from tokenizers import Tokenizer, models

    model = make_tiny_llama(tmp_path / "src")
    (model / "tokenizer.json").write_text("{}")  # the model's own, to be replaced
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>")).save(
        str(tokenizer / "tokenizer.json")
    )
    write_config(
        tmp_path / "compile.json",
        f"file://{model}",
        model={"uri": f"file://{model}", "tokenizer": f"file://{tokenizer}"},
    )
    out = tmp_path / "artifacts" / "abc123"
    compile_artifacts(tmp_path / "compile.json", out, log=lambda m: None)
    assert (out / "model" / "tokenizer.json").read_text() == (tokenizer / "tokenizer.json").read_text()
    write_config(
        tmp_path / "compile.json",
        f"file://{model}",
        model={"uri": f"file://{model}", "tokenizer": f"file://{model}/none"},
    )
    with pytest.raises(CompileError, match=f"model source unavailable: file://{model}/none: not found"):
        compile_artifacts(tmp_path / "compile.json", tmp_path / "other", log=lambda m: None)


def test_a_quantized_compile_stores_packed_weights_that_serving_loads_as_they_are(tmp_path):
    model = make_tiny_llama(tmp_path / "src")
    write_config(tmp_path / "compile.json", f"file://{model}", quantization="int4")
    out = tmp_path / "artifacts" / "abc123"
    compile_artifacts(tmp_path / "compile.json", out, log=lambda m: None)
    weights = load_file(str(out / "model" / "model.safetensors"))
    assert weights["model.layers.0.mlp.down_proj.qweight"].dtype == torch.uint8  # int4, two per byte
    assert weights["model.embed_tokens.qweight"].dtype == torch.int8
    assert not any(
        n.endswith("proj.weight") or n in ("lm_head.weight", "model.embed_tokens.weight") for n in weights
    )
    assert (
        json.loads((out / "model" / "config.json").read_text())["neuronfleet_quantization"]["kind"] == "int4"
    )
    runner = ModelRunner(out / "model", RuntimeConfig(slots=1, max_seq_len=64))  # as serving pods
    assert runner.quantization == "int4"


def test_a_model_sharing_the_claim_cannot_plant_the_artifacts_another_loads(tmp_path):
    """Two models on one cache claim, with the same compile identity (so the same predictable hash): what
    the first model's compile pod writes at that hash, and an old-layout folder in the claim's root, are not
    the second's cache hit. Each pod mounts only its model's folder of the claim (the compile Jobs as the
    operator builds them, their mounts as the local kubelet makes them, the second's command run for real)."""
    model = make_tiny_llama(tmp_path / "src")
    obj = {
        "apiVersion": "neuronfleet.dev/v1alpha1",
        "kind": "NeuronModel",
        "spec": {
            "model": {"uri": f"file://{model}"},
            "neuron": {"instanceType": "cpu", "sequenceLength": 64, "maxInputLength": 32, "batchSize": 2},
            "compile": {"cache": {"claimName": "shared"}},
        },
    }
    spec, errors = validation.parse(obj)
    assert not errors
    chash = builders.compile_hash(spec)
    claim = tmp_path / "claim"

    def compile_pod(name: str):
        objects = builders.build_all(builders.Owner(name, "ns", f"uid-{name}"), spec)
        (job,) = [o for o in objects if o["kind"] == "Job"]
        (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
        config = tmp_path / name / "config"
        config.mkdir(parents=True)
        for key, value in config_map["data"].items():
            (config / key).write_text(value)
        (tmp_path / name / "tmp").mkdir()
        container = job["spec"]["template"]["spec"]["containers"][0]
        volumes = {"cache": claim, "config": config, "tmp": tmp_path / name / "tmp"}
        return container, mounted_folders(container, volumes)

    _, attacker_mounts = compile_pod("other")
    victim, victim_mounts = compile_pod("chat")
    # the other model's pod writes a complete-looking folder at the hash, as its own compile would
    planted = Path(map_path(f"{CACHE_MOUNT}/artifacts/{chash}", attacker_mounts))
    for folder in (planted, claim / "artifacts" / chash):  # (and in the claim's root, the old layout)
        (folder / "model").mkdir(parents=True, exist_ok=True)
        (folder / "model" / "config.json").write_text('{"planted": true}')
        (folder / "manifest.json").write_text(json.dumps({"compileHash": chash, "engine": "embedded"}))
    assert f"{CONFIG_MOUNT}/compile.json" in victim["command"]
    log = tmp_path / "termination-log"
    run = subprocess.run(
        rewrite_command(victim["command"], {}, victim_mounts),
        capture_output=True, text=True, env={**os.environ, TERMINATION_LOG_ENV: str(log)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "cache hit" not in run.stderr and json.loads(log.read_text())["cacheHit"] is False
    out = Path(map_path(f"{CACHE_MOUNT}/artifacts/{chash}", victim_mounts))
    assert json.loads((out / "model" / "config.json").read_text()).get("planted") is None
    assert out.is_relative_to(claim / "models" / "chat")
    assert planted.is_relative_to(claim / "models" / "other")
    with pytest.raises(ValueError, match="leaves its volume"):  # a mount never reaches past its volume
        mounted_folders({"volumeMounts": [{"name": "c", "mountPath": "/c", "subPath": "../x"}]}, {"c": claim})
