"""What dtype `auto` means on this machine and for this model's weights, decided once per process.

bfloat16 where the CPU computes it natively, else float32. Without native support torch emulates bfloat16
matmuls (about 100x slower than float32 on an AVX2 machine, see the README's benchmark notes), so a prefill
would crawl. The check is torch's own CPU feature detection, `torch.cpu.get_capabilities()` (torch 2.13.0,
torch/cpu/__init__.py, from cpuinfo): on x86 the AVX512-BF16 or AMX-BF16 instructions (`avx512_bf16`,
`amx_bf16`), on ARM64 the BF16 extension (`bf16`, or `sve_bf16`). Other devices (Neuron) compute bfloat16
natively.

A model served with weight-only int8/int4 weights gets bfloat16 on every CPU: its quantized kernels take
bfloat16 activations whatever the model's dtype (`quantize`: their float32 paths are scalar loops), so
float32 buys those layers nothing, and the KV cache and activations in bfloat16 take half the memory. Measured
on a 2-core AVX2 EPYC without native bfloat16 (SmolLM2-135M int4, 64 slots, unprofiled decode step medians,
float32 against bfloat16 activations): 23.9 against 22.5 ms for 1 stream, 253 against 245 ms for 32; the
KV cache of 64 clients' requests 311 MiB in float32.
"""

from __future__ import annotations

from functools import cache

import torch

AUTO = "auto"
NATIVE_BF16_FEATURES = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")


@cache
def native_bfloat16() -> bool:
    capabilities = torch.cpu.get_capabilities()
    return any(bool(capabilities.get(name)) for name in NATIVE_BF16_FEATURES)


def resolve_dtype(name: str, device: str = "cpu", quantized: bool = False) -> str:
    """`auto` -> bfloat16 or float32 for this machine and these weights (`quantized`: weight-only int8 or
    int4 layers); any other name as it is."""
    if name != AUTO:
        return name
    if device != "cpu" or quantized:
        return "bfloat16"
    return "bfloat16" if native_bfloat16() else "float32"
