"""The KV cache's memory becomes resident as positions are written, not when the server starts: a cache
sized for every slot at max_seq_len costs what requests use (issue 17's peak-RSS goal)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from neuronfleet.runtime.llama import zeros_on_demand

MIB = 1 << 20


def resident_mib() -> float:
    """This process's resident set (VmRSS), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_costs_resident_memory_only_where_it_was_written(dtype):
    shape = (8, 2, 16, 64, 2, 32, 64)  # [layers, 2, blocks, slots, kv_heads, block, head_dim]: 256/512 MiB
    size_mib = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() / MIB
    gc.collect()
    before = resident_mib()
    cache = zeros_on_demand(shape, dtype, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == dtype
    assert resident_mib() - before < 0.05 * size_mib  # nothing committed yet

    cache[:, :, :2] = 1.5  # two of sixteen blocks written: 1/8 of the cache
    grown = resident_mib() - before
    assert size_mib / 8 * 0.9 < grown < size_mib / 8 + 0.05 * size_mib

    for block in range(16):  # one block at a time: no large temporaries in this process's heap
        assert cache[:, :, block].eq(1.5 if block < 2 else 0.0).all(), block  # the rest reads as zeros
    del cache
    gc.collect()
    assert resident_mib() - before < 0.05 * size_mib  # given back when the model goes


def test_an_empty_cache_is_an_ordinary_tensor():
    cache = zeros_on_demand((0, 4), torch.float32, torch.device("cpu"))
    assert cache.shape == (0, 4)
