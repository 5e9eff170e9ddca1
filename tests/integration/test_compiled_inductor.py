"""The model's passes compiled to C++ by Inductor (`--compiled-steps inductor`, in
runtime/model/compiled_steps.py) on a tiny random Llama in float32: a decode bucket and a prefill bucket after
a cached prefix give the logits and cache writes of the same passes op by op, within float32's rounding
(Inductor fuses and reorders sums). Needs a C++ compiler and Python's headers, as Inductor does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from support import make_tiny_llama

from neuronfleet.runtime.model.compiled_steps import CompiledSteps
from neuronfleet.runtime.model.llama import LlamaModel, PrefillBatch
from neuronfleet.runtime.model.model_config import load_model_config

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists(),
    reason="Inductor compiles C++: it needs g++ and Python's headers",
)


def test_inductor_graphs_equal_the_passes_op_by_op(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    folder = make_tiny_llama(tmp_path / "tiny")
    model = LlamaModel(folder, load_model_config(folder), 4, 128, torch.float32, torch.device("cpu"),
                       capture_decode=False, pack=False)  # fmt: skip
    steps = CompiledSteps(model, "inductor")
    gen = torch.Generator().manual_seed(0)
    state = torch.randn(model.kv_cache.shape, generator=gen)
    tokens = torch.randint(3, 500, (2, 16), generator=gen)
    positions = torch.arange(30, 46).expand(2, 16).contiguous()
    prefill = PrefillBatch(tokens, torch.tensor([15, 9]), torch.tensor([0, 1]), positions, context=64)
    decode = model.decode_batch(torch.tensor([5, 6]), torch.tensor([50, 12]), 64, None)
    cases = [
        (lambda: model.forward(prefill, None)[0], lambda: steps.prefill(prefill)),
        (lambda: model.forward(None, decode)[1], lambda: steps.decode(decode)),
    ]
    for op_by_op, compiled in cases:
        model.kv_cache.copy_(state)
        want = op_by_op()
        want_cache = model.kv_cache.clone()
        model.kv_cache.copy_(state)
        got = compiled()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model.kv_cache, want_cache, atol=1e-5, rtol=1e-5)


SERVE_WITHOUT_A_COMPILER = """
import json, sys
import torch
from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import Engine
from neuronfleet.runtime.engine.model_runner import ModelRunner
from neuronfleet.runtime.serving.sampling_params import SamplingParams
from neuronfleet.runtime.serving.tokenizer import Tokenizer
folder, tokenizer, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
config = RuntimeConfig(slots=1, max_seq_len=64, max_input_len=32, prefill_buckets=[32], decode_buckets=[64],
                       dtype="float32", compiled_steps="inductor")
runner = ModelRunner(folder, config)
engine = Engine(runner, Tokenizer(tokenizer, runner.model_config.eos_token_ids))
params = SamplingParams(max_tokens=8, ignore_eos=True)
answers = [engine.generate([p], params)[0].token_ids for p in prompts]
second = [*prompts[0], *answers[0], 7, 8, 9]  # the first prompt's next turn, after its cached prefix
answers.append(engine.generate([second], params)[0].token_ids)
steps = runner.compiled
print(json.dumps({"answers": answers, "loaded": sorted(map(list, steps.ahead.runners)),
                  "op_by_op": sorted(map(list, steps.ahead.missing)), "compiled_here": len(steps.buckets)}))
"""


def test_the_compile_jobs_graphs_are_loaded_by_a_pod_without_a_compiler_and_answer_as_op_by_op(
    tmp_path, smollm2_dir
):
    """`neuronfleet compile` with compiledSteps inductor writes a package per bucket of the pods' tables
    (graphs/, graphs.json); a process with no C++ compiler on its PATH loads them, compiles nothing, runs
    every step of a workload (prompts, decode, a turn after its cached prefix) from them, and answers as the
    passes op by op (greedy, float32). Two such pods at once, and a pod restarted after them, do the same
    from the same artifacts, which none of them changes; the compile Job run again is a cache hit."""
    from support import CEILING, neuronfleet_command

    from neuronfleet.runtime.engine.config import RuntimeConfig
    from neuronfleet.runtime.engine.engine import Engine
    from neuronfleet.runtime.engine.model_runner import ModelRunner
    from neuronfleet.runtime.model.compiled_ahead import GRAPHS_DIR, GRAPHS_MANIFEST
    from neuronfleet.runtime.serving.sampling_params import SamplingParams
    from neuronfleet.runtime.serving.tokenizer import Tokenizer

    tiny = make_tiny_llama(tmp_path / "tiny")
    config = {
        "compileHash": "g1", "engine": "embedded", "instanceType": "cpu", "model": {"uri": f"file://{tiny}"},
        "dtype": "float32", "sequenceLength": 64, "maxInputLength": 32, "batchSize": 1,
        "buckets": {"context": [32], "generation": [64]}, "compiledSteps": "inductor",
    }  # fmt: skip
    (tmp_path / "compile.json").write_text(json.dumps(config))
    out = tmp_path / "artifacts" / "g1"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    run = subprocess.run(
        [*neuronfleet_command(), "compile", "--config", str(tmp_path / "compile.json"), "--out", str(out)],
        capture_output=True, text=True, timeout=CEILING, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    model = out / "model"  # what the pods serve (engines.served_model_folder)
    manifest = json.loads((model / GRAPHS_DIR / GRAPHS_MANIFEST).read_text())
    assert sorted(manifest["graphs"].values()) == [["decode", 1, 64], ["prefill", 1, 32, 64]]

    prompts = [[(7 * i) % 400 + 3 for i in range(20)], [(11 * i) % 400 + 3 for i in range(12)]]
    no_compiler = tmp_path / "bin"
    no_compiler.mkdir()
    bare = {**env, "PATH": str(no_compiler), "CXX": str(no_compiler / "g++"), "CC": str(no_compiler / "gcc")}
    command = [sys.executable, "-P", "-c", SERVE_WITHOUT_A_COMPILER, str(model), str(smollm2_dir)]

    def pod() -> subprocess.Popen:
        return subprocess.Popen([*command, json.dumps(prompts)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=bare)  # fmt: skip

    def served(process: subprocess.Popen) -> dict:
        out, err = process.communicate(timeout=CEILING)
        assert process.returncode == 0, err
        return json.loads(out.strip().splitlines()[-1])

    artifacts = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    first, second = pod(), pod()  # two pods of the model at once
    results = [served(first), served(second)]
    results.append(served(pod()))  # a pod restarted
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == artifacts  # nobody wrote anything there
    for got in results:
        assert got["loaded"] == [["decode", 1, 64], ["prefill", 1, 32, 64]]
        assert got["op_by_op"] == [] and got["compiled_here"] == 0
        assert got["answers"] == results[0]["answers"]
    again = subprocess.run(
        [*neuronfleet_command(), "compile", "--config", str(tmp_path / "compile.json"), "--out", str(out)],
        capture_output=True, text=True, timeout=CEILING, env=env,
    )  # fmt: skip
    assert again.returncode == 0 and "cache hit" in again.stderr, again.stderr
    got = results[0]

    settings = dict(slots=1, max_seq_len=64, max_input_len=32, prefill_buckets=[32], decode_buckets=[64],
                    dtype="float32")  # fmt: skip
    runner = ModelRunner(model, RuntimeConfig(**settings))
    engine = Engine(runner, Tokenizer(smollm2_dir, runner.model_config.eos_token_ids))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [engine.generate([p], params)[0].token_ids for p in prompts]
    want.append(engine.generate([[*prompts[0], *want[0], 7, 8, 9]], params)[0].token_ids)
    assert got["answers"] == want
