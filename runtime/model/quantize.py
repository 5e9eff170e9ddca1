"""Weight-only quantization of the Llama linear layers (int8, int4), the LM head and the embedding (int8).

It owns the stored form of quantized weights, the one function that makes it from float weights
(`quantize_tensors`, run once at compile/import time, or at load for a plain folder served with
--quantization), and the layers that multiply with it on PyTorch's own packed CPU kernels (torch 2.13.0):

- int8: symmetric, one scale per output channel; `<name>.qweight` int8 [N, K] and `<name>.scales` [N].
  `aten._weight_int8pack_mm(x [M, K], qweight [N, K] int8, scales [N])` takes this plain layout as is.
- int4: asymmetric, one scale and zero per group of GROUP_SIZE input features of each output channel;
  `<name>.qweight` uint8 [N, K/2] (two values 0..15 per byte: feature 2j in the low nibble, 2j+1 in the
  high) and `<name>.scales_zeros` [N, K/GROUP_SIZE, 2] with w = (q - 8) * scale + zero, the formula of
  `aten._weight_int4pack_mm_for_cpu`. That kernel wants its own layout
  (`_convert_weight_to_int4pack_for_cpu`), which depends on the CPU the torch build dispatches to (blocks
  of 64 output channels with AVX512, 32 with AVX2; pytorch aten/src/ATen/native/cpu/int4mm_kernel.cpp,
  weight_to_int4pack_kernel): artifacts store
  the portable nibble form and the loader only re-lays the same 4-bit values out for this CPU (no rounding,
  no float weights read).
- The embedding and the LM head are int8 per row in both modes: a lookup reads a few rows, and the LM head
  of a tied model is the int8 embedding itself (no second copy). int4 there costs too much quality: on
  tests/data/perplexity_text.txt SmolLM2-135M's perplexity is 21.30 in bfloat16; int4 layers in groups of
  64 with an int4 head give 33.06 (+55%), groups of 32 with an int4 head 22.78 (+7%), groups of 32 with the
  int8 head 21.32 (+0.1%).

GROUP_SIZE 32, from those numbers: groups of 64 with the int8 head still give 29.75 (+40%) on this small
model, whose rows have outliers. The kernel accepts 32..256; 32 divides every Llama-family hidden and
intermediate size; its scale and zero (2 bfloat16 per 32 weights) cost one bit per weight on top of the 4.

Activations: the kernels' float32 paths are scalar loops in torch 2.13.0 (about 10x slower than a float32
matmul for a SmolLM2 projection on an AVX2 machine), their bfloat16 paths are vectorised; so a quantized
layer feeds the kernel bfloat16 (accumulating in float32) and returns the model's dtype.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from neuronfleet.runtime.model.dtypes import native_bfloat16
from neuronfleet.runtime.model.model_config import ModelConfig, ModelLoadError

KINDS = ("int8", "int4")
GROUP_SIZE = 32
CONFIG_KEY = "neuronfleet_quantization"  # in config.json: {"kind": ..., "group_size": ...}
KERNEL_DTYPE = torch.bfloat16
EMBED = "model.embed_tokens"


def linear_names(config: ModelConfig) -> list[str]:
    """The weights (without `.weight`) of the decoder layers' projections, quantized as `kind`."""
    names = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{n}_proj" for n in "qkvo"] + [
            p + f"mlp.{n}_proj" for n in ("gate", "up", "down")
        ]
    return names


def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return {"qweight": q.contiguous(), "scales": scales}


def quantize_int4(w: torch.Tensor, group: int = GROUP_SIZE) -> dict[str, torch.Tensor]:
    n, k = w.shape
    if k % group or n % 16:
        raise ModelLoadError(
            f"int4 needs weights whose input size is a multiple of {group} and output size a multiple of 16 "
            f"(torch's int4 kernel), got [{n}, {k}]; use --quantization int8"
        )
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return {"qweight": packed.contiguous(), "scales_zeros": torch.stack((scale, lo + 8 * scale), dim=-1)}


def quantize_tensors(
    tensors: dict[str, torch.Tensor], config: ModelConfig, kind: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Hugging Face float tensors -> the stored quantized form (float weights of quantized layers removed),
    and the config.json entry that says so. Norms and biases stay as they are."""
    if kind not in KINDS:
        raise ModelLoadError(f"quantization {kind!r} is not supported; choose one of {', '.join(KINDS)}")
    out = dict(tensors)
    quantize = quantize_int8 if kind == "int8" else quantize_int4
    embed = out.pop(EMBED + ".weight", None)
    if embed is None:
        raise ModelLoadError(f"the weights lack {EMBED}.weight")
    tied = config.tie_word_embeddings and "lm_head.weight" not in out
    if not tied:  # tied: the LM head reads the int8 embedding
        head = out.pop("lm_head.weight", None)
        if head is None:
            raise ModelLoadError("the weights lack lm_head.weight and the config does not tie embeddings")
        out.update({f"lm_head.{k}": v for k, v in quantize_int8(head).items()})
    out.update({f"{EMBED}.{k}": v for k, v in quantize_int8(embed).items()})
    for name in linear_names(config):
        w = out.pop(name + ".weight", None)
        if w is None:
            raise ModelLoadError(f"the weights lack {name}.weight")
        out.update({f"{name}.{k}": v for k, v in quantize(w).items()})
    return out, {"kind": kind, "group_size": GROUP_SIZE if kind == "int4" else None}


def kernel_aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it at a 64-byte boundary (where torch's CPU allocator puts every tensor it makes).

    torch 2.13.0's `_weight_int8pack_mm` on an AVX512 CPU (AMD EPYC Zen 4) dies of a segmentation
    fault for 16 or more rows when its weight does not start on a 16-byte boundary. A tensor read from a file
    mapping sits at its offset in the file (safetensors' own reader: 24 bytes past one for SmolLM2's
    embedding); `weights_file` gives each tensor memory of its own, but the layer does not rely on that."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`; t itself when it is in it already (a conversion to its own dtype is still an op: a
    decode step's graph would run two per layer, into the kernels' dtype and back)."""
    return t if t.dtype == dtype else t.to(dtype)


class Int8Linear:
    """y = x W^T + b with W int8 per output channel (aten._weight_int8pack_mm).

    That kernel's cost grows with the rows (torch 2.13.0), steeply for a layer as large as an LM head. A layer
    made with `widen_from_rows` (the LM head) instead multiplies that many rows or more with oneDNN's bfloat16
    matmul, widening the weight to bfloat16 one block of WIDEN_ELEMENTS at a time (int8 values are exact in
    bfloat16; the scales are applied to the result): faster from 16 rows where the CPU has native bfloat16,
    with the same error against float64, and only a few MiB of bfloat16 weights at any time. The decoder
    layers' small weights gain nothing that way, so they keep the kernel at every size (docs/benchmarks.md).
    """

    WIDEN_ELEMENTS = 4096 * 576  # a block of the widened weight: 4.5 MiB in bfloat16

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
        widen_from_rows: int | None = None,
    ) -> None:  # fmt: skip
        self.qweight, self.scales, self.bias = kernel_aligned(qweight), scales.to(KERNEL_DTYPE), bias
        self.widen_from_rows = widen_from_rows
        self.block = max(1, self.WIDEN_ELEMENTS // qweight.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xk = as_dtype(x, KERNEL_DTYPE)
        if self.widen_from_rows is None or x.shape[0] < self.widen_from_rows:
            y = torch.ops.aten._weight_int8pack_mm(xk, self.qweight, self.scales)
        else:
            q, n = self.qweight, self.qweight.shape[0]
            parts = [F.linear(xk, q[i : i + self.block].to(KERNEL_DTYPE)) for i in range(0, n, self.block)]
            y = (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).mul_(self.scales)
        y = as_dtype(y, x.dtype)
        return y if self.bias is None else y + self.bias


HEAD_WIDEN_FROM_ROWS = 16  # the LM head's rows from which Int8Linear widens blocks (docs/benchmarks.md)


def head_widen_from_rows() -> int | None:
    """The LM head's `widen_from_rows`: HEAD_WIDEN_FROM_ROWS where the CPU multiplies bfloat16 natively; None
    (the kernel at every size) elsewhere, where oneDNN emulates bfloat16 and the widened blocks are several
    times slower than the kernel (widened to float32 instead, no gain either). fbgemm's float16-weight GEMM
    on the int8 values (exact in float16), scales applied after, is a little faster there, but it is not
    used: fbgemm pads a packed weight's input features to a multiple of 512 (576 -> 1024 for SmolLM2), so
    that head holds far more memory than the int8 one, and on such a CPU int4 is chosen for memory."""
    return HEAD_WIDEN_FROM_ROWS if native_bfloat16() else None


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """The stored int4 form uint8 [N, K/2] -> its values 0..15 as uint8 [N, K] (low nibble first)."""
    return torch.stack((qweight & 0x0F, qweight >> 4), dim=-1).view(qweight.shape[0], -1)


class Int4Linear:
    """y = x W^T + b with W int4 in groups (aten._weight_int4pack_mm_for_cpu, in this CPU's layout)."""

    def __init__(self, qweight: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.group = 2 * qweight.shape[1] // scales_zeros.shape[1]
        values = unpack_int4(qweight).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
        self.scales_zeros = scales_zeros.transpose(0, 1).contiguous().to(KERNEL_DTYPE)  # [K/g, N, 2]
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xk = as_dtype(x, KERNEL_DTYPE)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, self.packed, self.group, self.scales_zeros)
        y = as_dtype(y, x.dtype)
        return y if self.bias is None else y + self.bias


class Int8Embedding:
    """Token lookup in an int8-per-row table: the rows asked for, scaled, in the model's dtype."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        self.qweight, self.scales, self.dtype = qweight, scales.to(dtype), dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.qweight).to(self.dtype) * self.scales[ids, None]


def quantized_linear(
    parts: list[dict[str, torch.Tensor]], bias: torch.Tensor | None
) -> Int8Linear | Int4Linear:
    """One layer from the stored parts of one or more weights fused along the output channels (q/k/v)."""
    cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    if "scales" in cat:
        return Int8Linear(cat["qweight"], cat["scales"], bias)
    return Int4Linear(cat["qweight"], cat["scales_zeros"], bias)


def quantize_folder(folder: Path, kind: str) -> None:
    """Rewrite a float model folder's weights as `kind` (one model.safetensors) and say so in config.json:
    what `neuronfleet compile` and `import-gguf --quantization` leave for the loader to read as it is."""
    from safetensors.torch import load_file, save_file

    from neuronfleet.runtime.model.model_config import load_model_config

    config = load_model_config(folder)
    raw = json.loads((folder / "config.json").read_text())
    if raw.get(CONFIG_KEY):
        raise ModelLoadError(f"{folder} is quantized already ({raw[CONFIG_KEY]})")
    shards = sorted(folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(str(shard)))
    out, entry = quantize_tensors(tensors, config, kind)
    for shard in shards:
        shard.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(
        {k: v.contiguous() for k, v in out.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    raw[CONFIG_KEY] = entry
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
