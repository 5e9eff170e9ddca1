"""The compiled passes made ahead by the compile Job (`runtime/model/compiled_ahead.py`), what needs no
C++ compiler: the exported step (weights and KV cache as inputs) computes the pass op by op and writes the
cache it is given; every bucket a serving workload runs is one of those compiled ahead; a key that differs is
named field by field and the pod runs op by op without compiling. Packages compiled and loaded without a
compiler are in tests/integration/test_compiled_inductor.py."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch
from support import make_tiny_llama

from neuronfleet.contract import compiled_buckets
from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import Engine
from neuronfleet.runtime.engine.model_runner import ModelRunner
from neuronfleet.runtime.model.compiled_ahead import (
    GRAPHS_DIR,
    GRAPHS_MANIFEST,
    _Step,
    _weight_slots,
    graph_key,
    key_mismatch,
    layer_caches,
)
from neuronfleet.runtime.model.compiled_steps import sample_inputs
from neuronfleet.runtime.model.llama import LlamaModel
from neuronfleet.runtime.model.model_config import load_model_config
from neuronfleet.runtime.serving.sampling_params import SamplingParams
from neuronfleet.runtime.serving.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def model_of(folder, slots: int = 2, max_seq: int = 64) -> LlamaModel:
    return LlamaModel(folder, load_model_config(folder), slots, max_seq, torch.float32, torch.device("cpu"),
                      capture_decode=False, pack=False)  # fmt: skip


@pytest.mark.parametrize("bucket", [("decode", 2, 64), ("prefill", 2, 16, 32)])
def test_the_exported_step_is_the_pass_with_weights_and_cache_given_and_writes_that_cache(tiny, bucket):
    """What a package holds, run as exported (no compiler): the logits of the pass op by op, the keys and
    values written into the cache given as an input; the model's own tensors are back in place after."""
    model = model_of(tiny)
    weights = [getattr(o, a) for o, a in _weight_slots(model)]
    gen = torch.Generator().manual_seed(1)
    inputs = list(sample_inputs(model, bucket))
    if bucket[0] == "decode":  # real positions and tokens: rows 0 and 1 at 40 and 7
        inputs = list(model.decode_batch(torch.tensor([5, 9]), torch.tensor([40, 7]), 64, None).inputs())
    else:
        inputs[0] = torch.randint(3, 500, (2, 16), generator=gen)
        inputs[3] = torch.arange(10, 26).expand(2, 16).contiguous()
        inputs[2] = torch.tensor([0, 1])
    state = torch.randn(model.kv_cache.shape, generator=gen)
    program = torch.export.export(
        _Step(model, bucket[0]), (layer_caches(model), weights, *inputs), strict=False
    )
    model.kv_cache.copy_(state)
    want = (model.decode_logits if bucket[0] == "decode" else model.prefill_logits)(*inputs)
    want_cache = model.kv_cache.clone()
    cache = state.clone()
    got = program.module()([cache[i, kv] for i in range(cache.shape[0]) for kv in (0, 1)], weights, *inputs)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(cache, want_cache)
    assert not torch.equal(cache, state)  # (the pass wrote keys and values)
    assert model.layer_kv[0][0].data_ptr() == model.kv_cache.data_ptr()  # the model's own caches are back


def test_every_bucket_a_serving_workload_runs_is_one_compiled_ahead(tiny, smollm2_dir):
    """Prompts of several lengths admitted together and alone, decode at several batch sizes, turns after
    their cached prefix: every bucket the runner ran (`aot_eager`, compiled as first run) is in the table the
    compile Job compiles (`compiled_buckets`), which `RuntimeConfig.compiled_graphs` counts."""
    config = RuntimeConfig(slots=2, max_seq_len=64, prefill_buckets=[16, 32], decode_buckets=[32, 64],
                           dtype="float32", compiled_steps="aot_eager")  # fmt: skip
    runner = ModelRunner(tiny, config)
    engine = Engine(runner, Tokenizer(smollm2_dir, runner.model_config.eos_token_ids))
    rng = random.Random(2)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 14, 27, 31)]
    answers = [o.token_ids for o in engine.generate(prompts, params)]
    engine.generate([[*prompts[1], *answers[1], 9, 9]], params)  # a next turn, after its cached prefix
    table = compiled_buckets(config.slots, config.prefill_buckets, config.decode_buckets)
    assert runner.compiled.buckets and runner.compiled.buckets <= set(table)
    assert len(table) == len(set(table)) == config.compiled_graphs
    assert {b[0] for b in runner.compiled.buckets} == {"decode", "prefill"}


def test_a_key_that_differs_is_named_field_by_field():
    here = {"torch": "2.13.0+cpu", "cpu": "avx512", "dtype": "bfloat16"}
    assert key_mismatch(dict(here), here) is None
    why = key_mismatch({**here, "cpu": "avx2", "dtype": "float32"}, here)
    assert "cpu avx2 (here avx512)" in why and "dtype float32 (here bfloat16)" in why
    assert "op by op" in why and "--compiled-steps off" in why


def runner_over(tiny, manifest: str, caplog) -> tuple[ModelRunner, dict]:
    """A compiled runner of the tiny model (1 slot, 64 tokens) whose folder holds graphs.json `manifest`
    (`{key}` replaced by this pod's key, as JSON), the warnings it logged in `caplog`; and that key."""
    config = RuntimeConfig(slots=1, max_seq_len=64, prefill_buckets=[32], decode_buckets=[64],
                           dtype="float32", compiled_steps="inductor")  # fmt: skip
    key = graph_key(model_of(tiny, 1, 64), tiny)
    folder = tiny / GRAPHS_DIR
    folder.mkdir(exist_ok=True)
    (folder / GRAPHS_MANIFEST).write_text(manifest.replace("{key}", json.dumps(key)))
    try:
        with caplog.at_level(logging.WARNING):
            return ModelRunner(tiny, config), key
    finally:
        (folder / GRAPHS_MANIFEST).unlink()


def test_graphs_made_for_another_pod_are_not_loaded_and_it_runs_op_by_op_compiling_nothing(tiny, caplog):
    """graphs.json whose key names another CPU: the runner says why and runs the passes op by op (no
    compiled steps at all, so nothing is compiled in the pod either)."""
    here = graph_key(model_of(tiny, 1, 64), tiny)
    runner, key = runner_over(tiny, json.dumps({"key": {**here, "cpu": "sse9"}, "graphs": {}}), caplog)
    assert runner.compiled is None
    assert f"cpu sse9 (here {key['cpu']})" in caplog.text


@pytest.mark.parametrize("broken", ["a package missing", "graphs.json not JSON"])
def test_graphs_that_cannot_be_loaded_are_said_and_it_runs_op_by_op(tiny, caplog, broken):
    """A graphs folder cut short or damaged (its key this pod's): the runner says what failed and serves op
    by op; the pod does not crash."""
    text = '{"key": {key}, "graphs": {"decode-1-64": ["decode", 1, 64]}}'
    runner, _ = runner_over(tiny, text if broken == "a package missing" else text[:-3], caplog)
    assert runner.compiled is None
    assert "could not be loaded" in caplog.text and "--compiled-steps off" in caplog.text
