"""Failures say why and recover once their cause is gone, in local mode (the real operator, kubelet, runtime
and `kubectl`):
- Pods that will not start: a scale-up whose new pod finds no compiled model (its artifacts were removed
  under it) crash-loops; the old pod keeps serving, the model stays Rolling with Degraded=True `PodsFailing`
  naming the pod, its restarts and the runtime's own reason, `kubectl get events` shows the Warning; once the
  artifacts are back the pod starts and the model is Ready again with a Normal Recovered.
- A model source that is not there yet: the compile fails saying so (CompileFailed with the compile's own
  message, status.compileRetryAt); the file is copied to the claim; the compile is tried again by itself and
  the model becomes Ready with no change to the spec.
- A model source that is there but broken: the compile fails with its own error; the operator fingerprints
  the source (a Job running `neuronfleet source-fingerprint`); the file is replaced by a good one; the next
  fingerprint differs, the compile runs again and the model becomes Ready with no change to the spec."""

from __future__ import annotations

import os
import shutil

import pytest
import yaml
from support import ROOT, chat, local_mode

from neuronfleet.contract import model_cache_folder

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
NAME = "smollm2"

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    # the operator fingerprints a failed compile's source every 3 s here, not every 10 minutes
    env = {**os.environ, "NEURONFLEET_SOURCE_CHECK_SECONDS": "3"}
    with local_mode(tmp_path_factory.mktemp("local"), env=env) as cluster:
        yield cluster


def degraded(model: dict) -> dict:
    return next(
        (c for c in (model.get("status") or {}).get("conditions") or [] if c["type"] == "Degraded"), {}
    )


def test_pods_that_cannot_start_are_a_warning_that_says_why_and_recover(local):
    manifest = yaml.safe_load(SAMPLE.read_text())
    local.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))
    model = lambda: local.get("nm", NAME)  # noqa: E731
    local.wait("Ready", lambda: (model().get("status") or {}).get("phase") == "Ready")
    status = model()["status"]
    endpoint, chash = status["endpoint"], status["compileHash"]
    claim = local.get("pvc", "-l", f"neuronfleet.dev/model={NAME}")["items"][0]["metadata"]["name"]
    volume = local.state / "node" / "volumes" / "default" / claim / model_cache_folder(NAME)
    artifacts = volume / "artifacts" / chash / "model"
    assert artifacts.is_dir(), artifacts
    moved = artifacts.with_name("model.moved")
    artifacts.rename(moved)  # the compiled model is gone from under the running pod

    manifest["spec"]["serving"]["unified"]["replicas"] = 2
    local.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))
    local.wait("Degraded PodsFailing", lambda: degraded(model()).get("reason") == "PodsFailing")
    message = degraded(model())["message"]
    assert f"pod {NAME}-unified-" in message and "is crash-looping" in message, message
    assert f"artifacts/{chash}/model" in message and "does not exist" in message, message
    assert model()["status"]["phase"] == "Rolling"  # the old pod serves on
    assert chat(endpoint, NAME, 4)[1]
    events = local.kubectl("get", "events", "--field-selector", f"involvedObject.name={NAME}").stdout
    warning = next(line for line in events.splitlines() if "PodsFailing" in line)
    assert "Warning" in warning and "crash-looping" in warning, events

    moved.rename(artifacts)  # back: the next restart starts
    local.wait(
        "Ready again",
        lambda: (
            (model().get("status") or {}).get("phase") == "Ready"
            and model()["status"]["readyReplicas"] == "2/2"
        ),
    )  # (the 2 serving pods; their front door is not counted)
    assert degraded(model())["status"] == "False"
    events = local.kubectl("get", "events", "--field-selector", f"involvedObject.name={NAME}").stdout
    assert any("Recovered" in line and "Normal" in line for line in events.splitlines()), events


def condition(model: dict, type_: str) -> dict:
    return next((c for c in (model.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def test_a_compile_whose_source_is_missing_is_tried_again_once_the_file_is_there(local):
    manifest = yaml.safe_load(SAMPLE.read_text())
    manifest["metadata"]["name"] = "later"
    manifest["spec"]["model"]["uri"] = "pvc://local-models/later/smollm2.gguf"
    local.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))
    model = lambda: local.get("nm", "later")  # noqa: E731
    local.wait("CompileFailed", lambda: condition(model(), "Compiled").get("reason") == "CompileFailed")
    status = model()["status"]
    message = condition(model(), "Compiled")["message"]
    said = "model source unavailable: pvc://local-models/later/smollm2.gguf: not found"
    assert message.count(said) == 1, message  # said once: the Job's own condition does not repeat it
    assert status["phase"] == "Failed" and status["compileRetryAt"], status
    assert "compiling again at" in condition(model(), "Progressing")["message"]

    models = local.state / "node" / "volumes" / "default" / "local-models"
    (models / "later").mkdir()
    shutil.copy(models / "smollm2-135m-instruct.gguf", models / "later" / "smollm2.gguf")
    local.wait("Ready with no change", lambda: (model().get("status") or {}).get("phase") == "Ready")
    assert model()["metadata"]["generation"] == 1 and model()["status"].get("compileRetryAt") is None
    events = local.kubectl("get", "events", "--field-selector", "involvedObject.name=later").stdout
    assert any("CompileRetried" in line and "readable now" in line for line in events.splitlines()), events


def test_a_compile_that_failed_on_a_broken_source_runs_again_once_the_source_is_replaced(local):
    models = local.state / "node" / "volumes" / "default" / "local-models"
    (models / "broken").mkdir()
    (models / "broken" / "model.gguf").write_bytes(b"not a GGUF file at all")
    manifest = yaml.safe_load(SAMPLE.read_text())
    manifest["metadata"]["name"] = "broken"
    manifest["spec"]["model"]["uri"] = "pvc://local-models/broken/model.gguf"
    local.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))
    model = lambda: local.get("nm", "broken")  # noqa: E731
    local.wait("CompileFailed, source fingerprinted", lambda: condition(model(), "Compiled").get("reason")
               == "CompileFailed" and (model().get("status") or {}).get("sourceFingerprint"))  # fmt: skip
    status = model()["status"]
    assert "compileRetryAt" not in status or status["compileRetryAt"] is None  # readable: not retried blind
    progressing = condition(model(), "Progressing")
    assert "model source changes" in progressing["message"] and progressing["status"] == "False", progressing
    assert progressing["message"].startswith("not compiling") and status["phase"] == "Failed"
    before = status["sourceFingerprint"]

    shutil.copy(models / "smollm2-135m-instruct.gguf", models / "broken" / "model.gguf")
    local.wait("Ready with no change", lambda: (model().get("status") or {}).get("phase") == "Ready")
    assert model()["metadata"]["generation"] == 1
    assert model()["status"].get("sourceFingerprint") is None  # cleared once compiled
    events = local.kubectl("get", "events", "--field-selector", "involvedObject.name=broken").stdout
    assert any("CompileRetried" in line and "source changed" in line for line in events.splitlines()), events
    assert before.startswith("files:1:")


def test_a_sequence_length_past_the_models_fails_its_compile_once_saying_so(local):
    """A sequenceLength past what the model was trained for (SmolLM2's GGUF says 8192) is refused as the
    compile starts, before any conversion; the refusal fails the Job at once (its podFailurePolicy: another
    pod would be refused the same way), one pod, one message, and the phase and conditions agree."""
    manifest = yaml.safe_load(SAMPLE.read_text())
    manifest["metadata"]["name"] = "too-long"
    manifest["spec"]["neuron"]["sequenceLength"] = 16384
    local.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))
    model = lambda: local.get("nm", "too-long")  # noqa: E731
    local.wait("CompileFailed", lambda: condition(model(), "Compiled").get("reason") == "CompileFailed")
    said = (
        "neuron.sequenceLength 16384 is past the model's max_position_embeddings (8192, its GGUF "
        "llama.context_length)"
    )
    message = condition(model(), "Compiled")["message"]
    assert message.count(said) == 1 and "PodFailurePolicy" in message, message
    assert model()["status"]["phase"] == "Failed"
    assert condition(model(), "Progressing")["message"].startswith("not compiling")
    pods = local.kubectl("get", "pods", "-l", "neuronfleet.dev/model=too-long,neuronfleet.dev/role=compile",
                         "-o", "name").stdout.split()  # fmt: skip
    assert len(pods) == 1, pods  # not backoffLimit + 1 of them
    local.kubectl("delete", "nm", "too-long")
