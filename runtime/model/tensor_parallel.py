"""Tensor parallelism of the model over torch.distributed: the split of the weights, and the sum across ranks.

Each of `world` ranks holds 1/world of every layer's query heads, key and value heads and MLP columns. This is
Megatron-LM's split: q, k, v, gate and up by their output rows; o and down by their input columns, whose
partial products the ranks then add (`all_reduce`). The embedding, the final norm and the LM head stay whole
on every rank. All ranks run the same pass on the same inputs, and each holds its own heads' KV cache. A bias
of o or down is held by rank 0 only, so the sum adds it once.

The sum is torch's functional all-reduce (`torch.distributed._functional_collectives`, torch 2.13.0). A
compiled graph holds it as an operator (`_c10d_functional.all_reduce` and `wait_tensor`), so a device backend
gets the collective inside its graph; op by op it runs as the process group's own allreduce. The process
group is gloo on CPU (the tests' proof that tensor parallelism 2 equals 1). On Trainium it is TorchNeuron's
`neuron` backend, a rank per NeuronCore (the Neuron docs, torch/guides/torch-distributed): the pods' ranks
and the compile Job's warming ranks (runtime/engine/tp_ranks.py, runtime/model/neuron_device.py), not yet run
on a device.

What is not split: weights stored quantized (their packed int8/int4 layouts are cut per tensor by
`quantize`, not here), refused with what works.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from neuronfleet.runtime.model.model_config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group: its rank of `world`, and the process group (None:
    torch.distributed's default group)."""

    rank: int
    world: int
    group: Any = None


def refusal(config: ModelConfig, world: int) -> str | None:
    """Why `config` cannot be split `world` ways, saying what can; None when it can."""
    if world < 1:
        return f"tensor parallelism must be at least 1, got {world}"
    counts = (
        ("attention heads", config.num_heads),
        ("key/value heads", config.num_kv_heads),
        ("MLP columns", config.intermediate_size),
    )
    uneven = [f"{name} {count}" for name, count in counts if count % world]
    if uneven:
        fits = [d for d in range(1, config.num_kv_heads + 1) if not any(count % d for _, count in counts)]
        return (
            f"tensor parallelism {world} must divide the model's {', '.join(uneven)}: use one of "
            f"{', '.join(map(str, fits))}"
        )
    return None


def local_config(config: ModelConfig, world: int) -> ModelConfig:
    """The shape one rank computes: its share of the heads, key/value heads and MLP columns."""
    return replace(
        config,
        num_heads=config.num_heads // world,
        num_kv_heads=config.num_kv_heads // world,
        intermediate_size=config.intermediate_size // world,
    )


def shard_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, shard: Shard) -> None:
    """Cut a float checkpoint's tensors (Hugging Face names) in place to this rank's share."""
    r, w, d = shard.rank, shard.world, config.head_dim

    def rows(name: str, per_rank: int) -> None:
        if name in tensors:
            tensors[name] = tensors[name][r * per_rank : (r + 1) * per_rank].contiguous()

    def columns(name: str, per_rank: int) -> None:
        tensors[name] = tensors[name][:, r * per_rank : (r + 1) * per_rank].contiguous()

    heads, kv_heads, columns_each = (
        config.num_heads // w,
        config.num_kv_heads // w,
        config.intermediate_size // w,
    )
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for suffix in ("weight", "bias"):
            rows(f"{p}self_attn.q_proj.{suffix}", heads * d)
            rows(f"{p}self_attn.k_proj.{suffix}", kv_heads * d)
            rows(f"{p}self_attn.v_proj.{suffix}", kv_heads * d)
            rows(f"{p}mlp.gate_proj.{suffix}", columns_each)
            rows(f"{p}mlp.up_proj.{suffix}", columns_each)
        columns(f"{p}self_attn.o_proj.weight", heads * d)
        columns(f"{p}mlp.down_proj.weight", columns_each)
        if r != 0:  # (the sum adds rank 0's bias once)
            tensors.pop(f"{p}self_attn.o_proj.bias", None)
            tensors.pop(f"{p}mlp.down_proj.bias", None)


def all_reduce(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The sum of `x` over the ranks (a graph-capturable functional collective)."""
    group = shard.group if shard.group is not None else torch.distributed.group.WORLD
    functional = torch.ops._c10d_functional
    return functional.wait_tensor(functional.all_reduce(x, "sum", group.group_name))
