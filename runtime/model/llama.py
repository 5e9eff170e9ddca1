"""The Llama-family model on torch: weights, the static KV cache and one forward pass (its device code).

It owns the model (RMSNorm, RoPE with Llama 3 / linear scaling, grouped-query attention, SwiGLU), its weights
(loaded from Hugging Face safetensors and fused per layer; weight-only int8/int4 layers from `quantize`), and
the static KV cache `[layers, 2, slots, kv_heads, positions, head_dim]` (positions 0..max_len; on CPU its
memory becomes resident only as positions are written). `forward` takes
a prefill group (prompts padded to a length bucket, written into given slots) and/or a decode batch (one token
for the slots `0..batch-1`, a batch bucket, over a length bucket of the cache): every shape is fixed by
(bucket, batch), so the same pass can be compiled (torch.compile, Neuron's device). Position `max_len` is a
scratch column that idle slots and padding write to, so a pass never touches a position it does not own.
A decode-only pass on CPU runs its layers from a graph recorded on its first step (`DecodeGraph`).
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import platform
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from neuronfleet.runtime.model import quantize, tensor_parallel, weights_file
from neuronfleet.runtime.model.model_config import ModelConfig, ModelLoadError

log = logging.getLogger(__name__)


class Linear:
    """y = x W^T + b, on CPU with the fastest kernel torch has for the shape.

    On CPU the weight is packed once, at load, into oneDNN's blocked layout, which `mkldnn._linear_pointwise`
    multiplies with (torch 2.13.0):
    - bfloat16/float16: torch's matmul would otherwise repack it on every call, which costs a quarter of a
      decode step. A single row (a decode step of one request) instead takes torch's own matrix-vector kernel
      on the plain weight, about 1.5x faster than oneDNN for one row; torch routes low-precision matmuls to
      oneDNN while it is enabled, so it is switched off around that call (the engine steps the model on one
      thread). The plain copy doubles these weights' memory on CPU, the price of that single-stream speed.
    - float32 (x86): oneDNN on the packed weight is faster than torch's own route (MKL) at every row count,
      and the plain weight is not kept (MKL's matrix-vector kernel reads memory at about half oneDNN's rate;
      docs/benchmarks.md). A weight `shared` with another tensor (a tied LM head reads the embedding table)
      is read in place, not packed into a copy, which is also faster.
    All accumulate in float32.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, shared: bool = False, pack: bool = True
    ) -> None:
        """`pack` False: the weight stays plain, for `F.linear` (what a compiler takes: `compiled_steps`)."""
        self.bias = bias
        self.weight: torch.Tensor | None = weight  # plain, for the kernels that take it
        self.packed: torch.Tensor | None = None  # what oneDNN reads
        self.one_row_plain = False  # a single row takes torch's matrix-vector kernel on the plain weight
        if not pack or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return
        if weight.dtype in (torch.bfloat16, torch.float16):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
                self.one_row_plain = True
            except RuntimeError:  # e.g. float16 on a CPU without AVX512-FP16: the plain kernels serve
                self.packed = None
        elif weight.dtype == torch.float32 and platform.machine() in ("x86_64", "AMD64"):
            if shared:
                self.packed = weight
            else:
                self.packed, self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 32), None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        plain = self.weight if self.one_row_plain else None
        if torch.jit.is_tracing():  # recorded as one node of ours (see PACKED_LINEAR)
            return torch.ops.neuronfleet.packed_linear(x, self.packed, plain, self.bias)
        return packed_matmul(x, self.packed, plain, self.bias)


def packed_matmul(
    x: torch.Tensor, packed: torch.Tensor, plain: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """x W^T + b on oneDNN's packed W; a single row on the `plain` W instead, where it is given, with torch's
    matrix-vector kernel (oneDNN switched off around it: torch routes low-precision matmuls to it)."""
    if x.shape[0] == 1 and plain is not None:
        torch._C._set_mkldnn_enabled(False)
        try:
            return F.linear(x, plain, bias)
        finally:
            torch._C._set_mkldnn_enabled(True)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


# `packed_matmul` as an operator of our own, which a graph capture (`DecodeGraph`) records as one node: the
# tracer of torch 2.13.0 cannot record `_linear_pointwise` (its `Scalar?[]` argument), nor the switch the
# one-row path flips; replayed, the node calls `packed_matmul`, which decides by the rows it is given.
PACKED_LINEAR = "packed_linear(Tensor x, Tensor packed, Tensor? plain, Tensor? bias) -> Tensor"
_ops = torch.library.Library("neuronfleet", "DEF")
_ops.define(PACKED_LINEAR)
_ops.impl("packed_linear", packed_matmul, "CompositeExplicitAutograd")  # (a packed weight is MkldnnCPU)


class HalfWeightLinear:
    """y = x W^T + b for float32 x with W held in float16: fbgemm's float16-weight GEMM
    (`quantized::linear_prepack_fp16` / `linear_dynamic_fp16`, torch 2.13.0), which widens W to float32 in
    registers and accumulates in float32, reading half of float32's bytes (`dtypes.resolve_weights_dtype`).
    The weight is rounded to nearest float16 once, at load. fbgemm would clamp what lies past float16's range
    (with a warning), so a weight that does not `fit` is not given to it: the loader holds it in float32."""

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        return bool(weight.abs().max() <= torch.finfo(torch.float16).max)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


AnyLinear = Linear | HalfWeightLinear | quantize.Int8Linear | quantize.Int4Linear


@dataclass
class LayerWeights:
    input_norm: RMSNorm
    qkv: AnyLinear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: AnyLinear  # [hidden, heads * head_dim]
    post_norm: RMSNorm
    gate_up: AnyLinear  # [2 * intermediate, hidden]
    down: AnyLinear  # [hidden, intermediate]


class Embedding:
    """Token lookup in a float table, as `dtype` (the activations'; the table's own when None)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        self.weight, self.dtype = weight, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight)
        return rows if self.dtype is None else quantize.as_dtype(rows, self.dtype)


@dataclass
class ModelWeights:
    embed: Embedding | quantize.Int8Embedding  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: RMSNorm
    lm_head: AnyLinear  # [vocab, hidden]; the embedding when tied
    quantization: str  # "none", or the kind of the weight-only quantized layers


def stored_quantization(model_dir: Path) -> str:
    """What config.json says the folder's weights are: none, or the quantization `quantize` wrote."""
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "none"
    entry = raw.get(quantize.CONFIG_KEY) or {}
    return str(entry.get("kind") or "none")


def load_weights(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    weights_dtype: torch.dtype | None = None,
    pack: bool = True,
    shard: tensor_parallel.Shard | None = None,
) -> ModelWeights:
    """Read Hugging Face safetensors (one file or shards) and fuse q/k/v and gate/up per layer.

    `quantization` None serves what the folder holds (float, or quantized by `neuronfleet compile`); int8 or
    int4 on a float folder quantizes it here, once; a quantized folder is loaded as stored (no rounding).
    `weights_dtype` (None: `dtype`) is what the float layers, the LM head and the embedding table are held
    in; float16 under float32 activations on CPU takes `HalfWeightLinear`, the one other pairing there is.
    `pack` False: float weights stay plain (`Linear`), as a compiler takes them. `shard`: only this rank's
    share of each layer is kept (`tensor_parallel`; float weights only).
    """
    half = weights_dtype not in (None, dtype)
    if half and (weights_dtype, dtype, device.type) != (torch.float16, torch.float32, "cpu"):
        raise ModelLoadError(
            f"weights held in {weights_dtype} under {dtype} activations on {device.type} have no kernel: "
            "float16 weights go with float32 activations on CPU; otherwise they are held in the activations'"
        )
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(weights_file.read_tensors(path))
    stored = stored_quantization(model_dir)
    kind = stored if quantization is None else quantization
    if stored != "none" and kind != stored:
        raise ModelLoadError(
            f"{model_dir} holds {stored} weights (neuronfleet compile quantized them); serve it with "
            f"--quantization {stored} or leave the flag out, or serve the float model for {kind}"
        )
    if kind != "none" and device.type != "cpu":
        raise ModelLoadError(f"quantization {kind} runs on torch's CPU kernels; the device is {device.type}")
    if shard is not None and shard.world > 1:
        if kind != "none":
            raise ModelLoadError(
                f"tensor parallelism splits float weights; {kind} weights are served whole: serve the float "
                "model, or at tensor parallelism 1"
            )
        tensor_parallel.shard_tensors(tensors, config, shard)
        config = tensor_parallel.local_config(config, shard.world)
    if stored == "none" and kind != "none":
        tensors, _ = quantize.quantize_tensors(tensors, config, kind)

    def take(name: str, required: bool = True) -> torch.Tensor | None:
        t = tensors.pop(name, None)
        if t is None:
            if required:
                raise ModelLoadError(f"weights in {model_dir} lack tensor {name!r}")
            return None
        return t.to(device=device, dtype=dtype).contiguous()

    def stored_parts(base: str) -> dict[str, torch.Tensor]:
        parts = {
            k: tensors.pop(f"{base}.{k}")
            for k in ("qweight", "scales", "scales_zeros")
            if f"{base}.{k}" in tensors
        }
        if "qweight" not in parts:
            raise ModelLoadError(f"weights in {model_dir} lack tensor {base + '.qweight'!r} ({kind})")
        return parts

    def float_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, shared: bool = False):
        """Held in float16 where the weights are and this one fits (fbgemm would clamp it); else `Linear`."""
        if half and HalfWeightLinear.fits(weight):
            return HalfWeightLinear(weight, bias)
        return Linear(weight, bias, shared, pack)

    def linear(bases: list[str], bias: torch.Tensor | None):
        if kind != "none":
            return quantize.quantized_linear([stored_parts(b) for b in bases], bias)
        weights = [take(b + ".weight") for b in bases]
        return float_linear(weights[0] if len(weights) == 1 else torch.cat(weights).contiguous(), bias)

    def cat(*parts: torch.Tensor | None) -> torch.Tensor | None:
        return None if parts[0] is None else torch.cat(parts, dim=0).contiguous()  # type: ignore[arg-type]

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        ab, mb = config.attention_bias, config.mlp_bias
        layers.append(
            LayerWeights(
                input_norm=RMSNorm(take(p + "input_layernorm.weight"), config.rms_norm_eps),
                qkv=linear(
                    [p + f"self_attn.{n}_proj" for n in "qkv"],
                    cat(*(take(p + f"self_attn.{n}_proj.bias", ab) for n in "qkv")) if ab else None,
                ),
                o=linear([p + "self_attn.o_proj"], take(p + "self_attn.o_proj.bias", False)),
                post_norm=RMSNorm(take(p + "post_attention_layernorm.weight"), config.rms_norm_eps),
                gate_up=linear(
                    [p + "mlp.gate_proj", p + "mlp.up_proj"],
                    cat(take(p + "mlp.gate_proj.bias", mb), take(p + "mlp.up_proj.bias", mb)) if mb else None,
                ),
                down=linear([p + "mlp.down_proj"], take(p + "mlp.down_proj.bias", False)),
            )
        )
    expected = (config.vocab_size, config.hidden_size)
    norm = RMSNorm(take("model.norm.weight"), config.rms_norm_eps)
    if kind != "none":
        embed_parts = stored_parts(quantize.EMBED)
        shape = tuple(embed_parts["qweight"].shape)
        # int8 in both modes; tied, the head and the lookup share one table, the head's aligned one
        tied = "lm_head.qweight" not in tensors
        head = embed_parts if tied else stored_parts("lm_head")
        lm_head = quantize.Int8Linear(
            head["qweight"], head["scales"], None, widen_from_rows=quantize.head_widen_from_rows()
        )
        table = lm_head.qweight if tied else embed_parts["qweight"]
        embed = quantize.Int8Embedding(table, embed_parts["scales"], dtype)
    else:
        table = take("model.embed_tokens.weight")
        shape = tuple(table.shape)
        head = table if config.tie_word_embeddings else take("lm_head.weight", required=False)
        if head is None:
            raise ModelLoadError(
                f"weights in {model_dir} lack 'lm_head.weight' and the config does not tie embeddings"
            )
        lm_head = float_linear(head, shared=head is table)  # (float16: packed from the float32 weight)
        if head is table:  # tied: the table is held as the head is
            table_half = isinstance(lm_head, HalfWeightLinear)
        else:
            table_half = half and HalfWeightLinear.fits(table)
        embed = Embedding(table.to(weights_dtype), dtype) if table_half else Embedding(table)
    if shape != expected:
        raise ModelLoadError(f"embedding shape {shape} does not match config.json's {expected}")
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head, quantization=kind)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with linear or Llama 3 style scaling."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    s = config.rope_scaling
    if s.rope_type == "linear":
        inv = inv / s.factor
    elif s.rope_type == "llama3":
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
    return inv.to(torch.float32)


class RMSNorm:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension, computed in float32.

    It is `F.layer_norm` over [x, -x], keeping the first half: that concatenation's mean is 0 and its
    variance is mean(x^2), so layer_norm's (x - mean) * rsqrt(var + eps) * w is RMSNorm's. One kernel (it
    computes in float32 and rounds once) and two small ops, where torch 2.13.0's `rms_norm` on CPU is a
    composite of about 8 ops for float32 x and 15 for bfloat16 or float16 (casts, pow, mean, rsqrt, ...), at
    microseconds of dispatch each; a decode step runs two a layer, and a one-stream step is faster this way
    (docs/benchmarks.md). (Over many float32 rows the norm alone is a little slower this way, which a whole
    step does not show.)
    """

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps
        self.width = weight.shape[0]  # an int: a capture records a tensor's size as ops
        self.doubled = torch.cat((weight, weight))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mirrored = torch.cat((x, -x), dim=-1)
        normed = F.layer_norm(mirrored, [2 * self.width], self.doubled, None, self.eps)
        return normed[..., : self.width].contiguous()


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == x.roll(half) * signed_sin(sin)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] rotated with the half-split (rotate_half) convention of Hugging Face Llama:
    x * cos + cat(-x2, x1) * sin, as three ops (cat(x2, x1) is x rolled by half)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


@dataclass
class PrefillBatch:
    """A prefill group: prompts right-padded to one length bucket, and the slots they go into.

    With `positions`, each row is the rest of a prompt whose first tokens' keys and values are already in its
    slot (a reused prefix): row p holds tokens at positions positions[p]; its padding points at the scratch
    column. Without, every row starts at position 0.
    """

    tokens: torch.Tensor  # [P, T]
    last_index: torch.Tensor  # [P]: each row's last real token, as an index into the row ([P, n]: n of them)
    slot_ids: torch.Tensor  # [P]
    positions: torch.Tensor | None = None  # [P, T]
    # with positions: the cache positions attention reads, a bucket at least the last position + 1 (a static
    # size for a compiled graph); None: exactly that, read from the positions
    context: int | None = None


@dataclass
class DecodeBatch:
    """One decode step for slots 0..B-1 (B a batch bucket) over a cache length bucket."""

    tokens: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]; idle slots: the scratch column
    rows: torch.Tensor | None  # the slots whose logits are wanted (all when None)
    slot_idx: torch.Tensor  # [B] = arange(B)
    cos: torch.Tensor  # [B, 1, D]
    sin: torch.Tensor
    mask: torch.Tensor  # [B, 1, 1, L] additive, L the length bucket

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """What the decode layers read, in `LlamaModel.decode_layers`' order (rows are the head's)."""
        return self.tokens, self.positions, self.slot_idx, self.cos, self.sin, self.mask


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose memory is committed as it is written. On CPU it lives in an anonymous mapping,
    whose pages the kernel hands out zeroed on first touch (small pages: no transparent huge pages), so a
    cache sized for every slot at `max_seq_len` costs resident memory only for the positions requests have
    used (each slot's positions of one head are contiguous, so a slot's first positions share pages).
    `torch.zeros` would write every page at once."""
    size = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or size == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # Private: a read of an untouched page maps the kernel's zero page (a shared mapping would commit it).
    # The tensor keeps the mapping alive (torch.frombuffer holds a reference).
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)  # else one write may commit 2 MiB
    return torch.frombuffer(memory, dtype=dtype).view(shape)


class _Holder(torch.nn.Module):
    """What `DecodeGraph` traces: `layers` on the first `n` inputs, and the objects it reads as attributes."""

    def __init__(self, layers, n: int, held) -> None:
        super().__init__()
        self.layers, self.n = layers, n
        for i, obj in enumerate(held):
            setattr(self, f"held{i}", obj)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.layers(*inputs[: self.n])


class DecodeGraph:
    """`LlamaModel.decode_layers` recorded once as a TorchScript graph (`torch.jit.trace`, torch 2.13.0) and
    replayed from C++: the same kernels on the same weights and KV cache, in the same order, so the same
    results bit for bit, without Python between the ops. The graph holds the weights and the cache by
    reference (no copy); one serves every (batch, length) bucket. It runs with TorchScript's optimizer off:
    it has nothing to fuse on CPU, and would profile and specialize again for new shapes.

    Recording runs the pass once, with its writes to the cache; the step then replays it and writes the same
    keys and values again. torch 2.13.0 marks `torch.jit.trace` deprecated (for torch.compile and
    torch.export, which compile C++ and need a compiler where the model is served); its notice is silenced.
    """

    def __init__(
        self, layers, inputs: tuple[torch.Tensor, ...], unrecordable: list[torch.Tensor],
        held: Sequence[torch.ScriptObject] = (),
    ) -> None:  # fmt: skip
        """`unrecordable`: tensors `layers` reads that a graph cannot hold as constants (oneDNN's packed
        weights); the graph takes them as inputs (the tracer knows a tensor it was given wherever it is read)
        and is given them at every call. `held`: the objects `layers` passes to operators (fbgemm's packed
        float16 weights); the tracer knows an object only as an attribute of the module it traces, so the
        graph is of a module holding them, and reads them from it."""
        self.unrecordable = tuple(unrecordable)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecation notice; TracerWarnings on the held tensors
            self.graph = torch.jit.trace(
                _Holder(layers, len(inputs), held), (*inputs, *self.unrecordable), check_trace=False
            )

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with torch.jit.optimized_execution(False):
            return self.graph(*inputs, *self.unrecordable)


class LlamaModel:
    """The weights, the rotary tables and the static KV cache of `slots` slots of `max_seq_len` positions."""

    def __init__(
        self, model_dir: Path, config: ModelConfig, slots: int, max_seq_len: int, dtype: torch.dtype,
        device: torch.device, quantization: str | None = None, capture_decode: bool = True,
        weights_dtype: torch.dtype | None = None, pack: bool = True,
        shard: tensor_parallel.Shard | None = None,
    ) -> None:  # fmt: skip
        """`pack` False: plain float weights (`load_weights`), for `compiled_steps`. `shard`: this rank's
        share of a tensor-parallel model (`tensor_parallel`): `config` becomes the share's shape, the KV cache
        holds its key and value heads, and the partial sums of o and down are added across the ranks."""
        self.shard = shard if shard is not None and shard.world > 1 else None
        if self.shard is not None and (why := tensor_parallel.refusal(config, self.shard.world)) is not None:
            raise ModelLoadError(why)
        self.weights = load_weights(
            model_dir, config, dtype, device, quantization, weights_dtype, pack, shard
        )
        if self.shard is not None:
            config = tensor_parallel.local_config(config, self.shard.world)
        self.config, self.slots, self.max_seq_len = config, slots, max_seq_len
        self.dtype, self.device = dtype, device
        # decode-only passes replay a graph of their layers recorded on the first one (on CPU: the device
        # it is tested on; not with a collective in the pass)
        self.capture_decode = capture_decode and device.type == "cpu" and self.shard is None
        self.decode_graph: DecodeGraph | None = None
        # Positions 0..max_seq_len (the last one: the scratch column idle decode rows write). Slot-major, and
        # positions contiguous per head: slots 0..B-1 over a length are [B, kv_heads, length, head_dim] views,
        # which attention reads in place at every batch size.
        shape = (config.num_layers, 2, slots, config.num_kv_heads, max_seq_len + 1, config.head_dim)
        self.kv_cache = zeros_on_demand(shape, dtype, device)
        positions = torch.arange(max_seq_len + 1, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(config))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos = emb.cos().to(dtype).to(device)
        self.rope_sin = signed_sin(emb.sin()).to(dtype).to(device)  # apply_rope's form
        # Each layer's key and value cache as views, made once (indexing kv_cache per layer and step costs
        # four ops a layer on the decode path).
        self.layer_kv = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(config.num_layers)]

    def _summed(self, x: torch.Tensor) -> torch.Tensor:
        """A row-split layer's partial product summed over the tensor-parallel ranks (itself on one)."""
        return x if self.shard is None else tensor_parallel.all_reduce(x, self.shard)

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        h = layer.post_norm(x)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        return x + self._summed(layer.down(F.silu(gate) * up))

    def _split_heads(self, qkv: torch.Tensor, *lead: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N, (H + 2 KV) D] -> q [*lead, H, D], k and v [*lead, KV, D]."""
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        return (
            q.view(*lead, c.num_heads, c.head_dim),
            k.view(*lead, c.num_kv_heads, c.head_dim),
            v.view(*lead, c.num_kv_heads, c.head_dim),
        )

    def _prefill_attention(self, layer: int, qkv: torch.Tensor, batch: PrefillBatch) -> torch.Tensor:
        """Causal attention within each padded prompt; writes its keys/values to cache positions [0, T)."""
        if batch.positions is not None:
            return self._prefill_after_prefix(layer, qkv, batch)
        p, t = batch.tokens.shape
        cos, sin = self.rope_cos[:t, None, :], self.rope_sin[:t, None, :]  # [T, 1, D]
        q, k, v = self._split_heads(qkv, p, t)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [P, H, T, D]
        k = apply_rope(k, cos, sin).transpose(1, 2)  # [P, KV, T, D]
        v = v.transpose(1, 2)
        # The padding past a prompt lands on positions its slot writes before it reads them.
        for cache, x in zip(self.layer_kv[layer], (k, v), strict=True):  # [slots, KV, positions, D]
            cache[:, :, :t].index_copy_(0, batch.slot_ids, x)
        window = self.config.sliding_window
        if window is not None and window < t:
            i = torch.arange(t, device=self.device)
            allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return attn.transpose(1, 2).reshape(p * t, -1)

    def _prefill_after_prefix(self, layer: int, qkv: torch.Tensor, batch: PrefillBatch) -> torch.Tensor:
        """Prompts' remaining tokens at their own positions, attending to the slot's cached prefix and to
        each other causally; their keys/values go into the cache first, then the fused kernel reads it."""
        c = self.config
        p, t = batch.tokens.shape
        positions = batch.positions  # [P, T]
        cos, sin = self.rope_cos[positions][:, :, None, :], self.rope_sin[positions][:, :, None, :]
        q, k, v = self._split_heads(qkv, p, t)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [P, H, T, D]
        cache_k, cache_v = self.layer_kv[layer]  # [slots, KV, positions, D]
        slots = batch.slot_ids[:, None]
        cache_k[slots, :, positions] = apply_rope(k, cos, sin)  # [P, T, KV, D]
        cache_v[slots, :, positions] = v
        real = positions.masked_fill(positions == self.max_seq_len, 0)  # padding attends like position 0
        n = batch.context if batch.context is not None else int(real.max()) + 1
        keys, values = cache_k[batch.slot_ids, :, :n], cache_v[batch.slot_ids, :, :n]  # [P, KV, n, D]
        span = torch.arange(n, device=self.device)
        allowed = span[None, None, :] <= real[:, :, None]  # [P, T, L]
        if c.sliding_window is not None:
            allowed &= span[None, None, :] > real[:, :, None] - c.sliding_window
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None], enable_gqa=True)
        return attn.transpose(1, 2).reshape(p * t, -1)

    def _decode_attention(self, layer: int, qkv: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """One new token per slot 0..B-1 against that slot's cache, over the length bucket."""
        c = self.config
        b = batch.tokens.shape[0]
        heads, kv_heads = c.num_heads, c.num_kv_heads
        qk, v = qkv.split(((heads + kv_heads) * c.head_dim, kv_heads * c.head_dim), dim=-1)
        # (-1 for the batch wherever a size is left to infer: a capture records each use of `b` as an op)
        qk = apply_rope(qk.reshape(-1, heads + kv_heads, c.head_dim), batch.cos, batch.sin)  # q and k at once
        q, k = qk.split((heads, kv_heads), dim=1)  # one op (two slices each would be four)
        v = v.view(-1, kv_heads, c.head_dim)
        cache_k, cache_v = self.layer_kv[layer]  # [slots, KV, positions, D]
        # cache[slot_idx, :, positions] = k, as the one op it is (written as an indexed assignment, a graph
        # capture would record a view of k to this batch's shape)
        torch.ops.aten.index_put_(cache_k, [batch.slot_idx, None, batch.positions], k)
        torch.ops.aten.index_put_(cache_v, [batch.slot_idx, None, batch.positions], v)
        # Slots 0..B-1 over the length bucket (the mask's length: a size a capture records), read in place:
        # [B, KV, L, D] with the cache's strides, one op each (`cache[:b, :, :length]` is three slices, a
        # graph records all three). The query heads that share a KV head act as that head's "query
        # positions" (one query per head), so no head is repeated.
        size = (b, kv_heads, batch.mask.shape[-1], c.head_dim)
        keys, values = cache_k.as_strided(size, cache_k.stride()), cache_v.as_strided(size, cache_v.stride())
        return F.scaled_dot_product_attention(
            q.view(-1, kv_heads, heads // kv_heads, c.head_dim), keys, values, attn_mask=batch.mask
        ).flatten(1)

    def decode_batch(self, tokens: torch.Tensor, positions: torch.Tensor, length: int, rows) -> DecodeBatch:
        c = self.config
        span = torch.arange(length, device=self.device)
        allowed = span[None, :] <= positions[:, None]
        if c.sliding_window is not None:
            allowed &= span[None, :] > positions[:, None] - c.sliding_window
        # additive, in the query's dtype (the fused kernel's)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill(
            ~allowed, float("-inf")
        )
        return DecodeBatch(
            tokens=tokens,
            positions=positions,
            rows=rows,
            slot_idx=torch.arange(tokens.shape[0], device=self.device),
            cos=self.rope_cos[positions][:, None, :],  # [B, 1, D]
            sin=self.rope_sin[positions][:, None, :],
            mask=mask[:, None, None, :],  # [B, 1, 1, L]
        )

    def decode_layers(
        self, tokens: torch.Tensor, positions: torch.Tensor, slot_idx: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, mask: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """A decode-only pass up to the final norm (`DecodeBatch.inputs()` -> [B, hidden]). Every size in it
        comes from its inputs' shapes (B from the tokens, the length bucket from the mask), so one captured
        graph of it serves every (batch, length) bucket."""
        w = self.weights
        batch = DecodeBatch(tokens, positions, None, slot_idx, cos, sin, mask)
        x = w.embed(tokens)
        for i, layer in enumerate(w.layers):
            qkv = layer.qkv(layer.input_norm(x))
            x = x + self._summed(layer.o(self._decode_attention(i, qkv, batch)))
            x = self._mlp(x, layer)
        return x

    def decode_logits(
        self, tokens: torch.Tensor, positions: torch.Tensor, slot_idx: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, mask: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """A decode-only pass to every row's logits (`DecodeBatch.inputs()` -> [B, vocab], float32): every
        size from the inputs' shapes, what `compiled_steps` compiles per (batch, length) bucket."""
        w = self.weights
        x = self.decode_layers(tokens, positions, slot_idx, cos, sin, mask)
        return w.lm_head(w.norm(x)).float()

    def prefill_logits(
        self, tokens: torch.Tensor, last_index: torch.Tensor, slot_ids: torch.Tensor,
        positions: torch.Tensor | None = None, context: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """A prefill-only pass (`PrefillBatch`'s fields) to the logits of each row's last tokens ([P * n,
        vocab], float32); what `compiled_steps` compiles per (rows, length, context) bucket."""
        w = self.weights
        batch = PrefillBatch(tokens, last_index, slot_ids, positions, context)
        x = w.embed(tokens.reshape(-1))
        for i, layer in enumerate(w.layers):
            qkv = layer.qkv(layer.input_norm(x))
            x = x + self._summed(layer.o(self._prefill_attention(i, qkv, batch)))
            x = self._mlp(x, layer)
        return w.lm_head(w.norm(self._last_rows(x, batch))).float()

    def _last_rows(self, x: torch.Tensor, prefill: PrefillBatch) -> torch.Tensor:
        """Of a prefill group's rows of hidden states ([P * T, hidden]), each prompt's last ones."""
        p, t = prefill.tokens.shape
        rows = torch.arange(p, device=self.device)[:, None]
        return x.view(p, t, -1)[rows, prefill.last_index.view(p, -1)].flatten(0, 1)

    def _linears(self) -> list[AnyLinear]:
        return [x for layer in self.weights.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def _unrecordable(self) -> list[torch.Tensor]:
        """The layers' tensors a graph cannot hold as constants (oneDNN's packed weights): its inputs."""
        return [x.packed for x in self._linears() if isinstance(x, Linear) and x.packed is not None]

    def _held(self) -> list[torch.ScriptObject]:
        """The layers' objects a graph reads from the module it traces (fbgemm's packed float16 weights)."""
        return [x.packed for x in self._linears() if isinstance(x, HalfWeightLinear)]

    def _decode_layers_run(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """`decode_layers` from its graph, recorded on the first decode-only pass (on CPU, unless
        --no-decode-graph; op by op otherwise, and after a recording that failed)."""
        if self.capture_decode and self.decode_graph is None:
            try:
                self.decode_graph = DecodeGraph(
                    self.decode_layers, inputs, self._unrecordable(), self._held()
                )
            except Exception as e:  # an op the tracer cannot record: this model decodes op by op
                log.warning("capturing the decode pass failed, it runs op by op: %s", e)
                self.capture_decode = False
        if self.decode_graph is not None:
            return self.decode_graph(inputs)
        return self.decode_layers(*inputs)

    @torch.inference_mode()
    def forward(
        self, prefill: PrefillBatch | None, decode: DecodeBatch | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One pass over the layers for a prefill group and/or a decode batch -> (prefill, decode) logits.

        Both ride through the same weight reads: every projection runs on the rows of both at once (decode on
        CPU and Neuron is bound by reading the weights), and only attention is split by kind.
        """
        w = self.weights
        n_pre = prefill.tokens.numel() if prefill else 0
        if prefill is None:
            x = self._decode_layers_run(decode.inputs())  # [B, hidden]
        else:
            parts = [w.embed(prefill.tokens.reshape(-1))]
            if decode:
                parts.append(w.embed(decode.tokens))
            x = torch.cat(parts) if len(parts) > 1 else parts[0]  # [N, hidden]
            for i, layer in enumerate(w.layers):
                qkv = layer.qkv(layer.input_norm(x))
                attn = [self._prefill_attention(i, qkv[:n_pre], prefill)]
                if decode:
                    attn.append(self._decode_attention(i, qkv[n_pre:], decode))
                x = x + self._summed(layer.o(torch.cat(attn) if len(attn) > 1 else attn[0]))
                x = self._mlp(x, layer)
        last = []  # only the rows whose next token is wanted go through the norm and the LM head
        if prefill:
            last.append(self._last_rows(x[:n_pre], prefill))
        if decode:
            rows = x[n_pre:]
            last.append(rows if decode.rows is None else rows.index_select(0, decode.rows))
        logits = w.lm_head(w.norm(torch.cat(last))).float()
        n_first = last[0].shape[0]
        if prefill and decode:
            return logits[:n_first], logits[n_first:]
        return (logits, None) if prefill else (None, logits)
