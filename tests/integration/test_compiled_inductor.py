"""The model's passes compiled to C++ by Inductor (`--compiled-steps inductor`, in
runtime/model/compiled_steps.py) on a tiny random Llama in float32: a decode bucket and a prefill bucket after
a cached prefix give the logits and cache writes of the same passes op by op, within float32's rounding
(Inductor fuses and reorders sums). Needs a C++ compiler and Python's headers, as Inductor does."""

from __future__ import annotations

import shutil
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
