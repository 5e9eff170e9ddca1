"""The KV cache's memory becomes resident as positions are written, not when the server starts: a cache
sized for every slot at max_seq_len costs what requests use (issue 17's peak-RSS goal). Measured as the
process's resident set (VmRSS, what a pod's memory use and the benchmark's peak RSS count)."""

from __future__ import annotations

import gc
import itertools
from pathlib import Path

import pytest
import torch

from neuronfleet.runtime.model.llama import zeros_on_demand

MIB = 1 << 20


def resident_mib() -> float:
    """This process's resident set (VmRSS), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_costs_resident_memory_only_where_it_was_written(dtype):
    shape = (8, 2, 16, 2, 1024, 64)  # [layers, 2, slots, kv_heads, positions, head_dim]: 256/128 MiB
    gc.collect()
    before = resident_mib()
    cache = zeros_on_demand(shape, dtype, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == dtype
    size_mib = cache.numel() * cache.element_size() / MIB
    assert resident_mib() - before < 0.05 * size_mib  # nothing committed yet

    cache[..., :128, :] = 1.5  # every slot's first 128 of 1024 positions written: 1/8 of the cache
    assert size_mib / 8 * 0.95 < resident_mib() - before < size_mib / 8 + 0.05 * size_mib

    for layer, start in itertools.product(range(8), range(0, 1024, 128)):  # the rest reads as zeros
        assert cache[layer, ..., start : start + 128, :].eq(1.5 if start == 0 else 0.0).all(), (layer, start)
    read = resident_mib()
    assert read - before < size_mib / 8 + 0.05 * size_mib  # reading zeros commits nothing

    del cache
    gc.collect()
    assert resident_mib() < read - 0.95 * size_mib / 8  # what was written is given back with the cache


def test_an_empty_cache_is_an_ordinary_tensor():
    cache = zeros_on_demand((0, 4), torch.float32, torch.device("cpu"))
    assert cache.shape == (0, 4)
