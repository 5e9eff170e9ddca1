"""Decode steps replayed from a recorded graph of the layers (`llama.DecodeGraph`) against the same steps run
op by op: the same next tokens, logits and KV cache, bit for bit, over batch buckets 1 to 4 (with idle slots
in a bucket) and across a length bucket, for int8 and int4 weights, float32 and bfloat16 ones (with
oneDNN's packed weights as the graph's inputs where this CPU packs them), and float16-held ones under float32
activations (fbgemm's packed weights, held by the traced module); one graph serves every bucket. A
capture that fails leaves the model decoding op by op, with the same results."""

from __future__ import annotations

import logging

import pinned_steps
import pytest
import torch
from support import make_tiny_llama

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.model_runner import ModelRunner
from neuronfleet.runtime.engine.prefix_cache import PrefixCache

SLOTS = 4
# which slots decode at each step: one request, two, all four, two with idle slots between them (bucket 4)
ROUNDS = [[0], [0, 1], [0, 1, 2, 3], [1, 3], [0, 2, 3], [0]]


def pair(folder, **config) -> tuple[ModelRunner, ModelRunner]:
    """The same model twice: decode steps from the recorded graph, and op by op."""
    settings = dict(slots=SLOTS, max_seq_len=256, **config)
    return (
        ModelRunner(folder, RuntimeConfig(**settings)),
        ModelRunner(folder, RuntimeConfig(**settings, decode_graph=False)),
    )


def decode_alike(graph: ModelRunner, eager: ModelRunner, steps_per_round: int = 5) -> int:
    """Prompts of 58-61 tokens into every slot, then ROUNDS of decode steps; after each step both runners
    chose the same tokens and hold the same cache. Returns the furthest position reached."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (58 + s,), generator=generator).tolist() for s in range(SLOTS)]
    caches = {id(r): PrefixCache(SLOTS) for r in (graph, eager)}

    def step(runner: ModelRunner, *args) -> tuple[list[int], list[int]]:  # greedy
        return pinned_steps.step(runner, caches[id(runner)], *args)

    first_a, _ = step(graph, range(SLOTS), prompts, [], [], [])
    first_b, _ = step(eager, range(SLOTS), prompts, [], [], [])
    assert first_a == first_b
    tokens, positions = dict(enumerate(first_a)), {s: len(p) for s, p in enumerate(prompts)}
    for slots in ROUNDS:
        for _ in range(steps_per_round):
            args = (slots, [tokens[s] for s in slots], [positions[s] for s in slots])
            _, next_a = step(graph, [], [], *args)
            _, next_b = step(eager, [], [], *args)
            assert next_a == next_b, (slots, positions)
            assert torch.equal(graph.model.kv_cache, eager.model.kv_cache), (slots, positions)
            for s, t in zip(slots, next_a, strict=True):
                tokens[s], positions[s] = t, positions[s] + 1
    # and the logits themselves, for a bucket of 4 with an idle slot
    at = [torch.tensor([tokens[s] for s in range(SLOTS)]), torch.tensor([positions[s] for s in range(SLOTS)])]
    rows = torch.tensor([0, 1, 3])
    logits = [r.model.forward(None, r.model.decode_batch(*at, 128, rows))[1] for r in (graph, eager)]
    assert torch.equal(*logits)
    return max(positions.values())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_layers_decode_from_one_graph_exactly_as_op_by_op(tmp_path, kind):
    graph, eager = pair(make_tiny_llama(tmp_path / "m"), quantization=kind)
    assert graph.model.capture_decode and not eager.model.capture_decode
    assert decode_alike(graph, eager) > 64  # the steps crossed a length bucket (64)
    captured = graph.model.decode_graph
    assert captured is not None and eager.model.decode_graph is None
    decode_alike(graph, eager, steps_per_round=1)  # from the start again: the same graph serves it
    assert graph.model.decode_graph is captured


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float_layers_decode_from_a_graph_exactly_as_op_by_op_packed_or_not(tmp_path, dtype):
    graph, eager = pair(make_tiny_llama(tmp_path / "m"), dtype=dtype)
    assert decode_alike(graph, eager) > 64
    assert graph.model.decode_graph is not None
    # oneDNN's packed weights (float32 on x86; bfloat16 where the CPU has it natively) are the graph's inputs
    packed = [x for layer in graph.model.weights.layers for x in (layer.qkv, layer.o) if x.packed is not None]
    assert len(graph.model.decode_graph.unrecordable) == len(packed) * 2


def test_float16_held_weights_decode_from_a_graph_exactly_as_op_by_op(tmp_path, float16_weights):
    """fbgemm's packed float16 weights are objects, not tensors: the graph reads them as attributes of the
    module it traces."""
    graph, eager = pair(make_tiny_llama(tmp_path / "m"))  # auto: float32 activations, float16 weights
    assert graph.weights_dtype_name == "float16"
    assert decode_alike(graph, eager) > 64
    assert graph.model.decode_graph is not None and not graph.model.decode_graph.unrecordable
    held = [
        x for layer in graph.model.weights.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    assert len(
        list(graph.model.decode_graph.graph.graph.findAllNodes("quantized::linear_dynamic_fp16"))
    ) == len(held)


def test_a_failed_capture_decodes_op_by_op_with_the_same_results(tmp_path, caplog, monkeypatch):
    graph, eager = pair(make_tiny_llama(tmp_path / "m"), quantization="int4")

    def refuse(*args, **kwargs):
        raise RuntimeError("an op the tracer cannot record")

    monkeypatch.setattr(torch.jit, "trace", refuse)  # (torch's tracer, not ours)
    with caplog.at_level(logging.WARNING, logger="neuronfleet.runtime.model.llama"):
        decode_alike(graph, eager)
    assert "capturing the decode pass failed, it runs op by op: an op the tracer cannot record" in caplog.text
    assert caplog.text.count("capturing the decode pass failed") == 1  # once, not at every step
    assert graph.model.decode_graph is None and not graph.model.capture_decode
