"""What dtype `auto` means on this machine, decided once per process.

bfloat16 where the CPU computes it natively, else float32. Without native support torch emulates bfloat16
matmuls (about 100x slower than float32 on an AVX2 machine, see the README's benchmark notes), so a prefill
would crawl. The check is torch's own CPU feature detection, `torch.cpu.get_capabilities()` (torch 2.13.0,
torch/cpu/__init__.py, from cpuinfo): on x86 the AVX512-BF16 or AMX-BF16 instructions (`avx512_bf16`,
`amx_bf16`), on ARM64 the BF16 extension (`bf16`, or `sve_bf16`). Other devices (Neuron) compute bfloat16
natively.
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


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """`auto` -> bfloat16 or float32 for this machine; any other name as it is."""
    if name != AUTO:
        return name
    if device != "cpu":
        return "bfloat16"
    return "bfloat16" if native_bfloat16() else "float32"
