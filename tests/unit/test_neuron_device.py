"""The Neuron device path (`runtime/model/neuron_device.py`) on this machine, the backend swapped (the tests'
recording backend, or `aot_eager`) and the device cpu, as the issue asks: the compile Job's part warms every
bucket of the pods' tables and writes warmed.json last; a pod copies the cache to its own disk, runs each
warmed bucket once and then compiles nothing (a bucket not warmed runs op by op, equal to it; a warmed one
runs its graph, equal to op by op); a cache warmed for another pod, or none, is said and the passes run op by
op; a pod without torch-neuronx is refused saying what runs. What only a device proves (NEFFs, the device's
memory, the numbers on Trainium) is tests/device/neuron_smoke.py."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from support import make_tiny_llama

from neuronfleet.contract import CompileConfig, compiled_buckets
from neuronfleet.runtime.artifacts.compile_artifacts import warm_neff
from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.model_runner import ModelRunner
from neuronfleet.runtime.model import neuron_device
from neuronfleet.runtime.model.compiled_steps import sample_inputs
from neuronfleet.runtime.model.llama import LlamaModel
from neuronfleet.runtime.model.model_config import load_model_config
from neuronfleet.runtime.progress import Reporter

SLOTS, MAX_SEQ = 2, 64


class Recorder:
    """A `torch.compile` backend that counts the graphs dynamo gives it and runs each as captured."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return gm.forward


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def model_of(folder) -> LlamaModel:
    return LlamaModel(folder, load_model_config(folder), SLOTS, MAX_SEQ, torch.float32, torch.device("cpu"),
                      capture_decode=False, pack=False)  # fmt: skip


def table() -> list[tuple]:
    return compiled_buckets(SLOTS, [16, 32], [32, MAX_SEQ])


@pytest.fixture
def target(monkeypatch):
    monkeypatch.setenv(neuron_device.TARGET_ENV, "trn2")
    monkeypatch.delenv(neuron_device.CACHE_ENV, raising=False)


def test_the_compile_job_warms_every_bucket_of_the_pods_tables_and_writes_warmed_json_last(
    tiny, tmp_path, target
):
    """`neuronfleet compile`'s Neuron phase with the backend swapped: the cache is named before anything is
    compiled, every bucket of the pods' tables is run once, and warmed.json says which, with the key."""
    out = tmp_path / "artifacts"
    out.mkdir()
    for f in tiny.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = CompileConfig.model_validate({
        "compileHash": "h", "model": {"uri": "pvc://m/"}, "instanceType": "trn2", "batchSize": SLOTS,
        "sequenceLength": MAX_SEQ, "maxInputLength": 32, "dtype": "float32", "compiledSteps": "neuron",
        "buckets": {"context": [16, 32], "generation": [32, MAX_SEQ]},
    })  # fmt: skip
    warm_neff(out, config, "float32", Reporter(), backend="aot_eager", device="cpu")
    manifest = json.loads((out / neuron_device.NEFF_DIR / neuron_device.WARMED).read_text())
    assert [tuple(b) for b in manifest["buckets"]] == table()
    assert manifest["key"] == neuron_device.neff_key(model_of(out), out, "aot_eager")
    assert manifest["key"]["target"] == "trn2" and manifest["key"]["dtype"] == "float32"
    assert os.environ[neuron_device.CACHE_ENV] == str(out / neuron_device.NEFF_DIR)


def test_a_pod_loads_the_warmed_buckets_once_and_then_compiles_nothing(tiny, tmp_path, target, caplog):
    """The pod's part: the cache copied to its own disk and named there; every warmed bucket run once (a
    graph each), then frozen: the warmed buckets run their graphs (equal to op by op) and a bucket the Job
    did not warm runs op by op, said once; no graph is made after the start."""
    warmed = table()[:-2]  # (the Job warmed all but two prefill buckets)
    neuron_device.write_warmed(
        tmp_path / "job", neuron_device.neff_key(model_of(tiny), tiny, Recorder()), warmed
    )
    (tiny / neuron_device.NEFF_DIR).mkdir(exist_ok=True)
    (tiny / neuron_device.NEFF_DIR / neuron_device.WARMED).write_text(
        (tmp_path / "job" / neuron_device.NEFF_DIR / neuron_device.WARMED).read_text()
    )
    try:
        manifest = neuron_device.use_local_cache(tiny, tmp_path / "local")
    finally:
        (tiny / neuron_device.NEFF_DIR / neuron_device.WARMED).unlink()
    assert os.environ[neuron_device.CACHE_ENV] == str(tmp_path / "local")
    assert (tmp_path / "local" / neuron_device.WARMED).is_file()
    model, recorder = model_of(tiny), Recorder()
    steps, why = neuron_device.warmed_steps(model, tiny, manifest, table(), recorder)
    assert why is None and steps is not None and steps.frozen
    assert recorder.graphs == len(warmed)  # one each, at start
    gen = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.WARNING):
        for bucket in [*table(), *table()]:
            # the inputs made as the runner makes a step's (outside inference mode), run in it as its passes
            inputs = list(sample_inputs(model, bucket))
            inputs[0] = torch.randint(3, 200, inputs[0].shape, generator=gen)  # tokens
            with torch.inference_mode():
                if bucket[0] == "decode":
                    want = model.decode_logits(*inputs)
                    got = steps._run(bucket, steps._decode, model.decode_logits, *inputs)
                else:
                    want = model.prefill_logits(*inputs)
                    got = steps._run(bucket, steps._prefill, model.prefill_logits, *inputs)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert recorder.graphs == len(warmed)  # serving compiled nothing
    assert steps.unwarmed == set(table()[-2:])
    assert caplog.text.count("no graph was warmed") == 2  # each said once


@pytest.mark.parametrize("case", ["none warmed", "another target", "another torch-neuronx"])
def test_a_cache_warmed_for_another_pod_or_none_is_said_and_the_passes_run_op_by_op(tiny, target, case):
    model = model_of(tiny)
    key = neuron_device.neff_key(model, tiny, "aot_eager")
    manifest = {
        "none warmed": None,
        "another target": {"key": {**key, "target": "trn3"}, "buckets": table()},
        "another torch-neuronx": {"key": {**key, "torch-neuronx": "2.14.3.1"}, "buckets": table()},
    }[case]
    steps, why = neuron_device.warmed_steps(model, tiny, manifest, table(), "aot_eager")
    assert steps is None
    said = {
        "none warmed": "no warmed NEFF cache",
        "another target": "target trn3 (here trn2)",
        "another torch-neuronx": f"torch-neuronx 2.14.3.1 (here {key['torch-neuronx']})",
    }[case]
    assert said in why and "op by op" in why and "compiling nothing" in why


def test_a_neuron_pod_without_torch_neuronx_is_refused_saying_what_runs(tiny, target):
    """`--compiled-steps neuron` runs on the neuron device; where torch-neuronx is not installed (this
    machine, or an image without it) the runner refuses before loading anything, naming the version and the
    image that has it."""
    try:
        import torch_neuronx  # noqa: F401

        pytest.skip("torch-neuronx is installed here")
    except ImportError:
        pass
    config = RuntimeConfig(slots=1, max_seq_len=64, prefill_buckets=[32], decode_buckets=[64],
                           compiled_steps="neuron")  # fmt: skip
    assert config.device == "neuron" and config.prefill_buckets == (32,)
    with pytest.raises(RuntimeError, match=r"torch-neuronx 2\.13\.3\.1.*runtime-neuron image"):
        ModelRunner(tiny, config)


def test_at_tensor_parallel_2_the_compile_job_warms_with_a_rank_each_and_keys_the_cache_by_it(
    tiny, tmp_path, target
):
    """The Job's warming at tensorParallel 2 (gloo and aot_eager here; `neuron` and a NeuronCore a rank on
    the device): a second rank started, both ranks' graphs run together (their all-reduces meet, else the
    Job would hang), warmed.json keyed by the degree; a pod at another degree is told, and runs op by op."""
    out = tmp_path / "artifacts"
    out.mkdir()
    for f in (f for f in tiny.iterdir() if f.is_file()):  # (the model's files, not an earlier test's neff/)
        (out / f.name).write_bytes(f.read_bytes())
    config = CompileConfig.model_validate({
        "compileHash": "h", "model": {"uri": "pvc://m/"}, "instanceType": "trn2", "batchSize": SLOTS,
        "sequenceLength": MAX_SEQ, "maxInputLength": 32, "dtype": "float32", "compiledSteps": "neuron",
        "buckets": {"context": [16, 32], "generation": [32, MAX_SEQ]}, "tensorParallel": 2,
    })  # fmt: skip
    warm_neff(out, config, "float32", Reporter(), backend="aot_eager", device="cpu")
    manifest = json.loads((out / neuron_device.NEFF_DIR / neuron_device.WARMED).read_text())
    assert [tuple(b) for b in manifest["buckets"]] == table()
    assert manifest["key"]["tensor_parallel"] == "2"
    steps, why = neuron_device.warmed_steps(model_of(out), out, manifest, table(), "aot_eager")
    assert steps is None and "tensor_parallel 2 (here 1)" in why
