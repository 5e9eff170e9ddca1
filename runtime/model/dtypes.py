"""What dtype `auto` means on this machine and for this model's weights, decided once per process.

bfloat16 where the CPU computes it natively, else float32. Without native support torch emulates bfloat16
matmuls (orders of magnitude slower than float32 on an AVX2 machine), so a prefill
would crawl. The check is torch's own CPU feature detection, `torch.cpu.get_capabilities()` (torch 2.13.0,
torch/cpu/__init__.py, from cpuinfo): on x86 the AVX512-BF16 or AMX-BF16 instructions (`avx512_bf16`,
`amx_bf16`), on ARM64 the BF16 extension (`bf16`, or `sve_bf16`). Other devices (Neuron) compute bfloat16
natively.

A model served with weight-only int8/int4 weights gets bfloat16 on every CPU: its quantized kernels take
bfloat16 activations whatever the model's dtype (`quantize`: their float32 paths are scalar loops), so
float32 buys those layers nothing (a step is no slower in bfloat16 even on an AVX2 CPU), and the KV cache and
activations in bfloat16 take half the memory (docs/benchmarks.md).

Where `auto` is float32 on an x86 CPU, the float layers' weights are held in float16 (`resolve_weights_dtype`)
and multiplied by fbgemm's float16-weight GEMM (part of torch's x86 builds), which widens them to float32 in
registers and accumulates in float32: a decode step is bound by reading the weights, and this reads half of
float32's bytes. Answers stay right: float16 keeps 11 bits of each weight (bfloat16, what `auto` serves where
the CPU has it, keeps 8), and weights published in bfloat16, as most checkpoints are, convert to it exactly.
It is about twice as fast as oneDNN's float32 for a decode step's few rows and at par for a long prefill,
with the same perplexity (docs/benchmarks.md). An explicit `float32` keeps float32 weights. Memory: fbgemm
(torch 2.13.0) pads a packed weight's input features to a multiple of 512 in memory, not in what a product
reads, so SmolLM2-135M's 576 take the room of 1024 and holding them in float16 saves far less than half.
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


@cache
def float16_weight_gemm() -> bool:
    """torch's fbgemm float16-weight GEMM (`quantized::linear_dynamic_fp16`, torch 2.13.0) runs here: an x86
    build with fbgemm on a CPU with AVX2 or wider (fbgemm's own requirement)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and (
        torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    )


def resolve_dtype(name: str, device: str = "cpu", quantized: bool = False) -> str:
    """`auto` -> bfloat16 or float32 for this machine and these weights (`quantized`: weight-only int8 or
    int4 layers); any other name as it is."""
    if name != AUTO:
        return name
    if device != "cpu" or quantized:
        return "bfloat16"
    return "bfloat16" if native_bfloat16() else "float32"


def resolve_weights_dtype(name: str, device: str = "cpu", quantized: bool = False) -> str:
    """The dtype the float layers' weights are held in (the activations': `resolve_dtype`): float16 where
    `auto` is float32 on a CPU with fbgemm's float16-weight GEMM, else the activations' own."""
    dtype = resolve_dtype(name, device, quantized)
    if name == AUTO and dtype == "float32" and device == "cpu" and float16_weight_gemm():
        return "float16"
    return dtype
