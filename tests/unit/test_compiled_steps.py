"""The model's passes as compiled graphs of static shapes (`runtime/model/compiled_steps.py`), on a tiny
random Llama in float32: a recording `torch.compile` backend shows one whole graph per bucket, none compiled
twice over a serving workload, only the KV cache written (in place), nothing read back to the host and no
operator of torch's CPU only in a graph; `aot_eager` (the graphs a device backend is given, traced, not
compiled) gives the logits and cache writes of the same passes op by op, and the engine's greedy answers equal
transformers'. Inductor (compiled to C++: a compiler, and seconds a graph) is in
tests/integration/test_compiled_inductor.py."""

from __future__ import annotations

import random

import pytest
import torch
from support import make_tiny_llama
from transformers import LlamaForCausalLM

from neuronfleet.runtime.engine.config import MAX_COMPILED_GRAPHS, RuntimeConfig
from neuronfleet.runtime.engine.engine import Engine
from neuronfleet.runtime.engine.model_runner import ModelRunner
from neuronfleet.runtime.model.compiled_steps import CompiledSteps, refusal
from neuronfleet.runtime.model.llama import LlamaModel, PrefillBatch
from neuronfleet.runtime.model.model_config import load_model_config
from neuronfleet.runtime.serving.sampling_params import SamplingParams
from neuronfleet.runtime.serving.tokenizer import Tokenizer

SLOTS, MAX_SEQ = 4, 128
CPU_ONLY = ("mkldnn", "quantized", "fbgemm", "_local_scalar_dense")  # no device graph holds these
HOST_READS = ("item", "tolist", "cpu", "numpy")  # a tensor's value read back to the host


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def plain_model(folder, pack: bool = False) -> LlamaModel:
    return LlamaModel(folder, load_model_config(folder), SLOTS, MAX_SEQ, torch.float32, torch.device("cpu"),
                      capture_decode=False, pack=pack)  # fmt: skip


class Recorder:
    """A `torch.compile` backend that keeps each graph dynamo captures and runs it as captured; it notes the
    inputs a graph writes (running it once on its example inputs, the real tensors: a pass writes the same
    keys and values to the same positions again when it is called) and their shapes (the graph's bucket)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.written: list[list[torch.Tensor]] = []
        self.signatures: list[tuple] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        before = [x.clone() for x in tensors]
        with torch.inference_mode():
            gm(*example_inputs)
        self.written.append([x for x, b in zip(tensors, before, strict=True) if not torch.equal(x, b)])
        self.signatures.append(tuple(tuple(x.shape) for x in tensors))
        self.graphs.append(gm)
        return gm.forward


def prefill_batch(model: LlamaModel, rows: int, length: int, start: int = 0) -> PrefillBatch:
    """`rows` prompts of `length` tokens into slots 0.., after `start` cached positions (context 64)."""
    gen = torch.Generator().manual_seed(rows * 1000 + length + start)
    tokens = torch.randint(3, 500, (rows, length), generator=gen)
    last = torch.full((rows,), length - 1)
    slots = torch.arange(rows)
    if not start:
        return PrefillBatch(tokens, last, slots)
    positions = torch.arange(start, start + length).expand(rows, length).contiguous()
    return PrefillBatch(tokens, last, slots, positions, context=64)


def run_both(model: LlamaModel, steps: CompiledSteps, kind: str, make) -> None:
    """One pass op by op and compiled, from the same random cache: equal logits and cache writes."""
    state = torch.randn_like(model.kv_cache)
    batch = make()
    model.kv_cache.copy_(state)
    want = model.forward(batch, None)[0] if kind == "prefill" else model.forward(None, batch)[1]
    want_cache = model.kv_cache.clone()
    model.kv_cache.copy_(state)
    got = steps.prefill(batch) if kind == "prefill" else steps.decode(batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.kv_cache, want_cache, atol=1e-6, rtol=1e-6)


def decode_batch(model: LlamaModel, batch: int, length: int, rows: list[int] | None = None):
    gen = torch.Generator().manual_seed(batch * 100 + length)
    tokens = torch.randint(3, 500, (batch,), generator=gen)
    positions = torch.randint(0, length, (batch,), generator=gen)
    return model.decode_batch(tokens, positions, length, None if rows is None else torch.tensor(rows))


def test_each_bucket_is_one_whole_graph_writing_only_the_kv_cache_in_place(tiny):
    """Decode over (batch, length) and prefill over (rows, length, context) buckets, repeated: a graph each
    bucket, once; each graph writes the KV cache and nothing else, reads nothing back to the host and holds
    no operator of torch's CPU only; the compiled passes equal op by op (same cache, same logits)."""
    from torch._dynamo.utils import counters

    model = plain_model(tiny)
    recorder = Recorder()
    steps = CompiledSteps(model, recorder)
    counters.clear()
    cases = [
        ("decode", lambda: decode_batch(model, 1, 32)),
        ("decode", lambda: decode_batch(model, 2, 32, rows=[1])),  # (rows picked after the graph)
        ("decode", lambda: decode_batch(model, 4, 64)),
        ("prefill", lambda: prefill_batch(model, 1, 16)),
        ("prefill", lambda: prefill_batch(model, 2, 16)),
        ("prefill", lambda: prefill_batch(model, 1, 16, start=20)),  # after a cached prefix
    ]
    for kind, make in [*cases, *cases]:
        run_both(model, steps, kind, make)
    assert len(recorder.graphs) == len(cases)  # one each bucket; the second round compiled nothing
    assert len(set(recorder.signatures)) == len(cases)
    assert not counters["graph_break"]
    cache = model.kv_cache.untyped_storage().data_ptr()
    for gm, written in zip(recorder.graphs, recorder.written, strict=True):
        assert written and all(x.untyped_storage().data_ptr() == cache for x in written)
        for node in gm.graph.nodes:
            assert not (node.op == "call_method" and node.target in HOST_READS), node.format_node()
            assert not any(name in str(node.target) for name in CPU_ONLY), node.format_node()


def test_aot_eager_graphs_equal_the_passes_op_by_op(tiny):
    """Traced through AOTAutograd (functionalized: the cache writes made copies, then written back) and run
    as traced: the same logits and the same cache."""
    model = plain_model(tiny)
    steps = CompiledSteps(model, "aot_eager")
    run_both(model, steps, "decode", lambda: decode_batch(model, 2, 64))
    run_both(model, steps, "prefill", lambda: prefill_batch(model, 2, 16))
    run_both(model, steps, "prefill", lambda: prefill_batch(model, 2, 16, start=30))


def test_a_model_with_cpu_only_weights_or_a_bad_backend_is_refused_saying_what_works(tiny):
    packed = plain_model(tiny, pack=True)
    assert "plain float weights" in (refusal(packed) or "")
    with pytest.raises(ValueError, match="--compiled-steps off"):
        CompiledSteps(packed, "aot_eager")
    with pytest.raises(ValueError, match="one of inductor, aot_eager, neuron"):
        CompiledSteps(plain_model(tiny), "eager-ish")
    model = plain_model(tiny)
    with pytest.raises(ValueError, match="context bucket"):
        CompiledSteps(model, "aot_eager").prefill(PrefillBatch(
            torch.ones(1, 4, dtype=torch.long), torch.tensor([3]), torch.tensor([0]), torch.arange(4)[None]
        ))  # fmt: skip
    with pytest.raises(ValueError, match="takes float weights; --quantization int8"):
        RuntimeConfig(compiled_steps="aot_eager", quantization="int8")
    with pytest.raises(ValueError, match="choose one of off, inductor, aot_eager, neuron"):
        RuntimeConfig(compiled_steps="xla")


def test_a_bucket_table_that_makes_too_many_graphs_is_refused_saying_what_to_give():
    """The default tables (made for op by op: many buckets, padding cheap) make over a thousand graphs; a
    compiled server is refused with the count and a table that fits, which it then takes."""
    many = RuntimeConfig().compiled_graphs
    assert many > MAX_COMPILED_GRAPHS
    with pytest.raises(
        ValueError, match=rf"up to {many} .* more than {MAX_COMPILED_GRAPHS}: give fewer"
    ) as e:
        RuntimeConfig(compiled_steps="inductor")
    suggested = str(e.value).split("(e.g. ")[1].split(")")[0].split()
    prefill, decode = suggested[1], suggested[3]
    fits = RuntimeConfig(compiled_steps="inductor", prefill_buckets=[int(b) for b in prefill.split(",")],
                         decode_buckets=[int(b) for b in decode.split(",")])  # fmt: skip
    # decode: 4 batch sizes x 1 length; prefill: 4 row counts x (prompts up to 128: 1 context; longer: 1)
    assert fits.compiled_graphs == 4 + 4 * 2


def test_the_engine_on_compiled_passes_answers_as_transformers_and_compiles_no_bucket_twice(
    tiny, smollm2_dir
):
    """A serving workload (prompts of several lengths together, a conversation's second turn after its
    cached prefix) on `--compiled-steps aot_eager`, its backend recorded: greedy answers equal transformers'
    (float32); run again, no graph is compiled anew."""
    settings = dict(slots=SLOTS, max_seq_len=MAX_SEQ, prefill_buckets=[16, 32, 64], dtype="float32")
    runner = ModelRunner(tiny, RuntimeConfig(**settings, compiled_steps="aot_eager"))
    assert runner.compiled is not None and runner.model.decode_graph is None
    recorder = Recorder()
    runner.compiled = CompiledSteps(runner.model, recorder, graphs=64)  # (the same passes, recorded)
    engine = Engine(runner, Tokenizer(smollm2_dir, runner.model_config.eos_token_ids))
    reused = []
    engine.step_observers.append(lambda report: reused.append(report.reused_prompt_tokens))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (9, 23, 40)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    reference = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()

    def greedy(ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)  # fmt: skip
        return out[0, len(ids) :].tolist()

    def workload() -> list[list[int]]:
        first = [o.token_ids for o in engine.generate(prompts, params)]
        second = [*prompts[1], *first[1], *[rng.randrange(3, 500) for _ in range(6)]]  # its next turn
        return [*first, engine.generate([second], params)[0].token_ids], second

    answers, second = workload()
    assert answers == [greedy(p) for p in [*prompts, second]]
    graphs = len(recorder.graphs)
    assert any(reused)  # (the second turn was prefilled after its cached prefix)
    workload()
    assert len(recorder.graphs) == graphs  # every bucket of the workload compiled once
