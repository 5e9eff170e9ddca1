"""The torch backend: all device code of the runtime lives here.

It owns the Llama-family model (RMSNorm, RoPE with Llama 3 / linear scaling, grouped-query attention, SwiGLU),
its weights (loaded from Hugging Face safetensors and fused per layer), the static KV cache
`[layers, 2, blocks, slots, kv_heads, KV_BLOCK, head_dim]` (positions 0..max_len, in blocks) and the sampler.
Its two entry points are shaped like Neuron's compiled graphs: `prefill` runs a group of prompts, padded to a
length bucket, into given slots; `decode` runs one token for the slots `0..batch-1` (a batch bucket) over a
length bucket of the cache. Every shape is fixed by (bucket, batch) so the same functions can be compiled
(torch.compile, Neuron's device). Position `max_len` is a scratch column that idle slots and padding write
to, so a step never touches a position it does not own.

A slot keeps what it holds after its request ends. A prompt that starts with tokens some slot holds (a chat
template's preamble, a shared system prompt, a conversation's earlier turns) skips prefilling them
(`plan_prefixes`): read in place when it is the prompt's own slot (the scheduler prefers such a slot,
`reusable_prefix`), else copied from that slot first, which costs far less than computing them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from .model_config import ModelConfig, ModelLoadError, load_model_config
from .sampling_params import SamplingParams

MIN_PREFIX_REUSE = 8  # tokens: a shorter common prefix is prefilled again
KV_BLOCK = (
    32  # positions per KV cache block: the cache is [layers, 2, blocks, slots, kv_heads, KV_BLOCK, head_dim]
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_length_buckets(max_len: int, smallest: int = 64, per_octave: int = 2) -> list[int]:
    """`per_octave` evenly spaced lengths per doubling from `smallest`, up to `max_len` (the last bucket).

    With 2 per octave (64, 96, 128, 192, ...) padding wastes under a third; with 4 (16, 20, 24, 28, 32, 40,
    ...) under a fifth. The number of shapes (graphs to compile on Neuron) stays logarithmic in `max_len`.
    """
    buckets, b = [], smallest
    while b < max_len:
        buckets += [n for n in (b + b * k // per_octave for k in range(per_octave)) if n < max_len]
        b *= 2
    return [*buckets, max_len]


def pick_bucket(buckets: Sequence[int], n: int) -> int:
    """The smallest bucket that holds `n`."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class Linear:
    """y = x W^T + b, on CPU with the fastest kernel torch has for the shape.

    In bfloat16/float16 the weight is also packed once, at load, into oneDNN's blocked layout: torch's matmul
    would otherwise repack it on every call, which costs a quarter of a decode step. A single row (a decode
    step of one request) instead takes torch's own matrix-vector kernel on the plain weight, about 1.5x faster
    than oneDNN for one row; torch routes low-precision matmuls to oneDNN while it is enabled, so it is
    switched off around that call (the engine steps the model on one thread). Both kernels accumulate in
    float32. The plain copy doubles these weights' memory on CPU, the price of that single-stream speed.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.weight = weight
        self.packed = None
        if (
            weight.device.type == "cpu"
            and weight.dtype in (torch.bfloat16, torch.float16)
            and torch.backends.mkldnn.is_available()
        ):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
            except RuntimeError:  # e.g. float16 on a CPU without AVX512-FP16: the plain kernels serve
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 1:
            torch._C._set_mkldnn_enabled(False)
            try:
                return F.linear(x, self.weight, self.bias)
            finally:
                torch._C._set_mkldnn_enabled(True)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: Linear  # [hidden, heads * head_dim]
    post_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear  # [hidden, intermediate]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: Linear  # [vocab, hidden]; the embedding itself when tied


def load_weights(
    model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> ModelWeights:
    """Read Hugging Face safetensors (one file or shards) and fuse q/k/v and gate/up per layer."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name)

    def take(name: str, required: bool = True) -> torch.Tensor | None:
        t = tensors.pop(name, None)
        if t is None:
            if required:
                raise ModelLoadError(f"weights in {model_dir} lack tensor {name!r}")
            return None
        return t.to(device=device, dtype=dtype).contiguous()

    def cat(*parts: torch.Tensor | None) -> torch.Tensor | None:
        return None if parts[0] is None else torch.cat(parts, dim=0).contiguous()  # type: ignore[arg-type]

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        ab, mb = config.attention_bias, config.mlp_bias
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=Linear(
                    cat(*(take(p + f"self_attn.{n}_proj.weight") for n in "qkv")),
                    cat(*(take(p + f"self_attn.{n}_proj.bias", ab) for n in "qkv")) if ab else None,
                ),
                o=Linear(take(p + "self_attn.o_proj.weight"), take(p + "self_attn.o_proj.bias", False)),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=Linear(
                    cat(take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")),
                    cat(take(p + "mlp.gate_proj.bias", mb), take(p + "mlp.up_proj.bias", mb)) if mb else None,
                ),
                down=Linear(take(p + "mlp.down_proj.weight"), take(p + "mlp.down_proj.bias", False)),
            )
        )
    embed = take("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else take("lm_head.weight", required=False)
    if lm_head is None:
        raise ModelLoadError(
            f"weights in {model_dir} lack 'lm_head.weight' and the config does not tie embeddings"
        )
    expected = (config.vocab_size, config.hidden_size)
    if tuple(embed.shape) != expected:
        raise ModelLoadError(f"embedding shape {tuple(embed.shape)} does not match config.json's {expected}")
    return ModelWeights(embed=embed, layers=layers, norm=take("model.norm.weight"), lm_head=Linear(lm_head))


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] rotated with the half-split (rotate_half) convention of Hugging Face Llama."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@dataclass
class SlotSampler:
    """Per-slot sampling state: the request's parameters and its own (seeded, reproducible) generator."""

    params: SamplingParams
    generator: torch.Generator | None = None
    history: list[int] = field(default_factory=list)  # prompt + output ids, for the repetition penalty


@dataclass
class PrefillBatch:
    """A prefill group: prompts right-padded to one length bucket, and the slots they go into.

    With `positions`, each row is the rest of a prompt whose first tokens' keys and values are already in its
    slot (a reused prefix): row p holds tokens at positions positions[p]; its padding points at the scratch
    column. Without, every row starts at position 0.
    """

    tokens: torch.Tensor  # [P, T]
    last_index: torch.Tensor  # [P]: each row's last real token, as an index into the row
    slot_ids: torch.Tensor  # [P]
    positions: torch.Tensor | None = None  # [P, T]


@dataclass
class DecodeBatch:
    """One decode step for slots 0..B-1 (B a batch bucket) over a cache length bucket."""

    tokens: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]; idle slots: the scratch column
    length: int
    rows: torch.Tensor | None  # the slots whose logits are wanted (all when None)
    slot_idx: torch.Tensor  # [B] = arange(B)
    block: torch.Tensor  # [B]: the cache block and the offset in it of each row's position
    offset: torch.Tensor
    cos: torch.Tensor  # [B, 1, D]
    sin: torch.Tensor
    mask: torch.Tensor  # [B, 1, 1, L] additive


class ModelRunner:
    """Holds weights and the static KV cache; runs bucketed prefill and decode and samples the next tokens."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        slots: int = 8,
        max_seq_len: int = 2048,
        prefill_buckets: Sequence[int] | None = None,
        decode_buckets: Sequence[int] | None = None,
        dtype: str | None = None,
        device: str = "cpu",
        prefix_reuse: bool = True,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = load_model_config(self.model_dir)
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if not 1 <= max_seq_len <= self.config.max_position_embeddings:
            raise ValueError(
                f"max_seq_len {max_seq_len} must be between 1 and the model's "
                f"max_position_embeddings ({self.config.max_position_embeddings})"
            )
        dtype = dtype or "float32"
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device)
        self.slots = slots
        self.max_seq_len = max_seq_len
        # Prefill is compute-bound (padding costs in proportion), decode reads the cache (coarser is fine).
        self.prefill_buckets = self._check_buckets(prefill_buckets, "prefill", smallest=16, per_octave=4)
        self.decode_buckets = self._check_buckets(decode_buckets, "decode", smallest=64, per_octave=2)
        if self.decode_buckets[-1] != max_seq_len:
            raise ValueError(f"the largest decode bucket must equal max_seq_len ({max_seq_len})")
        self.batch_buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < slots] + [slots]
        self.weights = load_weights(self.model_dir, self.config, self.dtype, self.device)
        c = self.config
        # Positions 0..max_seq_len (the last one: the scratch column idle decode rows write), in blocks.
        self.kv_blocks = -(-(max_seq_len + 1) // KV_BLOCK)
        shape = (c.num_layers, 2, self.kv_blocks, slots, c.num_kv_heads, KV_BLOCK, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        positions = torch.arange(max_seq_len + 1, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(c))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos = emb.cos().to(self.dtype).to(self.device)
        self.rope_sin = emb.sin().to(self.dtype).to(self.device)
        self.samplers: dict[int, SlotSampler] = {}
        self.prefix_reuse = prefix_reuse
        self.cached: list[list[int]] = [
            [] for _ in range(slots)
        ]  # per slot: the tokens at positions 0, 1, ...

    def _check_buckets(
        self, buckets: Sequence[int] | None, kind: str, smallest: int, per_octave: int
    ) -> list[int]:
        if buckets is None:
            return default_length_buckets(self.max_seq_len, smallest, per_octave)
        out = sorted(set(int(b) for b in buckets))
        if not out or out[0] < 1 or out[-1] > self.max_seq_len:
            raise ValueError(
                f"{kind} buckets {list(buckets)} must be between 1 and max_seq_len ({self.max_seq_len})"
            )
        return out

    @property
    def max_prompt_len(self) -> int:
        return self.prefill_buckets[-1]

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    # ---- model ---------------------------------------------------------------------------------------------

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        h = rms_norm(x, layer.post_norm, self.config.rms_norm_eps)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        return x + layer.down(F.silu(gate) * up)

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
        # Whole blocks: the padding past the prompt lands on positions the slot writes before it reads them.
        n = -(-t // KV_BLOCK)
        for i, x in ((0, k), (1, v)):
            blocks = F.pad(x, (0, 0, 0, n * KV_BLOCK - t)).view(p, x.shape[1], n, KV_BLOCK, -1)
            self.kv_cache[layer, i, :n].index_copy_(1, batch.slot_ids, blocks.transpose(0, 2).transpose(1, 2))
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
        block, offset, slots = positions // KV_BLOCK, positions % KV_BLOCK, batch.slot_ids[:, None]
        self.kv_cache[layer, 0, block, slots, :, offset] = apply_rope(k, cos, sin)  # [P, T, KV, D]
        self.kv_cache[layer, 1, block, slots, :, offset] = v
        real = positions.masked_fill(positions == self.max_seq_len, 0)  # padding attends like position 0
        n = int(real.max()) // KV_BLOCK + 1
        keys = self.kv_cache[layer, 0, :n, batch.slot_ids].permute(1, 2, 0, 3, 4).flatten(2, 3)
        values = self.kv_cache[layer, 1, :n, batch.slot_ids].permute(1, 2, 0, 3, 4).flatten(2, 3)
        span = torch.arange(n * KV_BLOCK, device=self.device)
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
        qk = apply_rope(qk.reshape(b, heads + kv_heads, c.head_dim), batch.cos, batch.sin)  # q and k at once
        q, k = qk[:, :heads], qk[:, heads:]
        v = v.view(b, kv_heads, c.head_dim)
        cache_k, cache_v = self.kv_cache[layer, 0], self.kv_cache[layer, 1]  # [blocks, slots, KV, BLOCK, D]
        cache_k[batch.block, batch.slot_idx, :, batch.offset] = k
        cache_v[batch.block, batch.slot_idx, :, batch.offset] = v
        # The query heads that share a KV head act as that head's "query positions" (one query per head).
        kv, group, n, length = (
            c.num_kv_heads,
            c.num_heads // c.num_kv_heads,
            batch.length // KV_BLOCK,
            batch.length,
        )
        if b == self.slots:
            # The first n blocks of all slots are contiguous [n, slots * KV, BLOCK, D] batches of matrices:
            # two batched matmuls read them in place, at about twice the speed of the fused attention kernel.
            keys = cache_k[:n].view(n, b * kv, KV_BLOCK, c.head_dim)
            values = cache_v[:n].view(n, b * kv, KV_BLOCK, c.head_dim)
            q = q.reshape(1, b * kv, group, c.head_dim).expand(n, -1, -1, -1)
            scores = torch.matmul(q, keys.transpose(-1, -2))  # [n, B * KV, G, BLOCK]
            scores = scores.permute(1, 2, 0, 3).reshape(b, kv, group, length)
            probs = torch.softmax(scores.float() * (c.head_dim**-0.5) + batch.mask, dim=-1).to(values.dtype)
            probs = probs.view(b * kv, group, n, KV_BLOCK).permute(2, 0, 1, 3)  # [n, B * KV, G, BLOCK]
            return torch.matmul(probs, values).sum(0).view(b, -1)
        # Fewer rows than slots: those blocks are strided batches, which matmul would copy (slowly) anyway, so
        # gather them into [B, KV, L, D] (small at small B) for the fused kernel.
        keys = cache_k[:n, :b].permute(1, 2, 0, 3, 4).reshape(b, kv, length, c.head_dim)
        values = cache_v[:n, :b].permute(1, 2, 0, 3, 4).reshape(b, kv, length, c.head_dim)
        return F.scaled_dot_product_attention(
            q.view(b, kv, group, c.head_dim), keys, values, attn_mask=batch.mask
        ).reshape(b, -1)

    def _decode_batch(self, tokens: torch.Tensor, positions: torch.Tensor, length: int, rows) -> DecodeBatch:
        c = self.config
        length = -(-length // KV_BLOCK) * KV_BLOCK  # whole cache blocks
        span = torch.arange(length, device=self.device)
        allowed = span[None, :] <= positions[:, None]
        if c.sliding_window is not None:
            allowed &= span[None, :] > positions[:, None] - c.sliding_window
        # The in-place path adds the mask to float32 scores; the fused kernel wants the query's dtype.
        mask_dtype = torch.float32 if tokens.shape[0] == self.slots else self.dtype
        mask = torch.zeros(allowed.shape, dtype=mask_dtype, device=self.device).masked_fill(
            ~allowed, float("-inf")
        )
        return DecodeBatch(
            tokens=tokens,
            positions=positions,
            length=length,
            rows=rows,
            slot_idx=torch.arange(tokens.shape[0], device=self.device),
            block=positions // KV_BLOCK,
            offset=positions % KV_BLOCK,
            cos=self.rope_cos[positions][:, None, :],  # [B, 1, D]
            sin=self.rope_sin[positions][:, None, :],
            mask=mask[:, None, None, :],  # [B, 1, 1, L]
        )

    @torch.inference_mode()
    def forward(
        self, prefill: PrefillBatch | None, decode: DecodeBatch | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One pass over the layers for a prefill group and/or a decode batch -> (prefill, decode) logits.

        Both ride through the same weight reads: every projection runs on the rows of both at once (decode on
        CPU and Neuron is bound by reading the weights), and only attention is split by kind.
        """
        c, w = self.config, self.weights
        n_pre = prefill.tokens.numel() if prefill else 0
        parts = []
        if prefill:
            parts.append(F.embedding(prefill.tokens.reshape(-1), w.embed))
        if decode:
            parts.append(F.embedding(decode.tokens, w.embed))
        x = torch.cat(parts) if len(parts) > 1 else parts[0]  # [N, hidden]
        for i, layer in enumerate(w.layers):
            qkv = layer.qkv(rms_norm(x, layer.input_norm, c.rms_norm_eps))
            attn = []
            if prefill:
                attn.append(self._prefill_attention(i, qkv[:n_pre], prefill))
            if decode:
                attn.append(self._decode_attention(i, qkv[n_pre:], decode))
            x = x + layer.o(torch.cat(attn) if len(attn) > 1 else attn[0])
            x = self._mlp(x, layer)
        last = []  # only the rows whose next token is wanted go through the norm and the LM head
        if prefill:
            p, t = prefill.tokens.shape
            last.append(x[:n_pre].view(p, t, -1)[torch.arange(p, device=self.device), prefill.last_index])
        if decode:
            rows = x[n_pre:]
            last.append(rows if decode.rows is None else rows.index_select(0, decode.rows))
        logits = w.lm_head(rms_norm(torch.cat(last), w.norm, c.rms_norm_eps)).float()
        n_first = last[0].shape[0]
        if prefill and decode:
            return logits[:n_first], logits[n_first:]
        return (logits, None) if prefill else (None, logits)

    def forward_prefill(
        self, tokens: torch.Tensor, last_index: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        """tokens [P, T] (right-padded to bucket T), last_index [P], slot_ids [P] -> logits [P, vocab]."""
        return self.forward(PrefillBatch(tokens, last_index, slot_ids), None)[0]

    def forward_decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, length: int, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [B], positions [B] for slots 0..B-1 over cache length bucket `length` -> logits of `rows`.

        Idle slots carry position `max_seq_len` (the scratch column), outside every length bucket.
        """
        return self.forward(None, self._decode_batch(tokens, positions, length, rows))[1]

    # ---- slots and sampling --------------------------------------------------------------------------------

    def start_slot(self, slot: int, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        """Set up a slot's sampler before its prefill."""
        generator = None
        if not params.greedy:
            generator = torch.Generator(device="cpu")
            if params.seed is not None:
                generator.manual_seed(params.seed)
            else:
                generator.seed()
        history = list(prompt_ids) if params.repetition_penalty != 1.0 else []
        self.samplers[slot] = SlotSampler(params=params, generator=generator, history=history)

    def release_slot(self, slot: int) -> None:
        """The request leaves the slot; the keys and values it wrote stay, for a later prompt that starts the
        same way (see `reusable_prefix`)."""
        self.samplers.pop(slot, None)

    @torch.inference_mode()
    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy cache positions [0, length) of slot src into slot dst (whole blocks: the positions past
        `length` that come along are written by dst's next step before anything reads them)."""
        n = -(-length // KV_BLOCK)
        self.kv_cache[:, :, :n, dst] = self.kv_cache[:, :, :n, src]
        self.cached[dst] = self.cached[src][:length]

    @torch.inference_mode()
    def export_kv(self, slot: int, length: int, layer: int | None = None) -> torch.Tensor:
        """Keys and values of positions [0, length) of a slot, contiguous: [layers, 2, kv_heads, length,
        head_dim], or one layer's [2, kv_heads, length, head_dim] (to send layer by layer)."""
        n = -(-length // KV_BLOCK)
        cache = self.kv_cache[:, :, :n, slot] if layer is None else self.kv_cache[layer, :, :n, slot]
        # [.., n, KV, BLOCK, D] -> [.., KV, n * BLOCK, D]
        blocks = cache.movedim(-4, -3).flatten(-3, -2)
        return blocks[..., :length, :].contiguous()

    @torch.inference_mode()
    def import_kv(self, slot: int, kv: torch.Tensor, token_ids: Sequence[int]) -> None:
        """Place keys and values computed elsewhere ([layers, 2, kv_heads, len, head_dim] for the first len
        tokens of token_ids) into a slot, which then holds those tokens for prefix reuse."""
        c = self.config
        length = len(token_ids)
        expected = (c.num_layers, 2, c.num_kv_heads, length, c.head_dim)
        if tuple(kv.shape) != expected or kv.dtype != self.dtype:
            raise ValueError(
                f"KV of shape {tuple(kv.shape)} {kv.dtype} does not fit: expected {expected} {self.dtype}"
            )
        n = -(-length // KV_BLOCK)
        padded = F.pad(kv, (0, 0, 0, n * KV_BLOCK - length))  # [L, 2, KV, n * BLOCK, D]
        blocks = padded.unflatten(-2, (n, KV_BLOCK)).movedim(-3, -4)  # [L, 2, n, KV, BLOCK, D]
        self.kv_cache[:, :, :n, slot] = blocks.to(self.device)
        self.cached[slot] = list(token_ids)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Move a running request from slot src to slot dst: its cache positions [0, length) and its sampler.
        src keeps its copy of the cache for prefix reuse."""
        self.copy_prefix(src, dst, length)
        sampler = self.samplers.pop(src, None)
        if sampler is not None:
            self.samplers[dst] = sampler

    def reusable_prefix(self, slot: int, prompt_ids: Sequence[int]) -> int:
        """How many leading tokens of a prompt the slot's own cache already holds: the longest common prefix
        with what the slot last held, less the prompt's last token (its logits are needed), and none when
        shorter than MIN_PREFIX_REUSE (not worth a scattered prefill)."""
        if not self.prefix_reuse:
            return 0
        held = self.cached[slot]
        n, limit = 0, min(len(held), len(prompt_ids) - 1)
        while n < limit and held[n] == prompt_ids[n]:
            n += 1
        return n if n >= MIN_PREFIX_REUSE else 0

    def plan_prefixes(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """For a prefill group: per prompt, the slot whose cache holds its longest prefix and that prefix's
        length (0: prefill it all). The prompt's own slot wins ties (no copy); slots this group writes into
        are never another prompt's source."""
        targets = set(slots)
        sources = [s for s in range(self.slots) if s not in targets]
        plan = []
        for slot, ids in zip(slots, prompts, strict=True):
            best = (slot, self.reusable_prefix(slot, ids))
            for other in sources:
                n = self.reusable_prefix(other, ids)
                if n > best[1]:
                    best = (other, n)
            plan.append(best)
        return plan

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, slots: Sequence[int]) -> list[int]:
        """One next token per row of `logits` [N, vocab], row i belonging to `slots[i]`."""
        samplers = [self.samplers[s] for s in slots]
        for row, s in enumerate(samplers):
            if s.params.repetition_penalty != 1.0 and s.history:
                ids = torch.tensor(sorted(set(s.history)), dtype=torch.long, device=logits.device)
                seen = logits[row, ids]
                pen = s.params.repetition_penalty
                logits[row, ids] = torch.where(seen > 0, seen / pen, seen * pen)
        out = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(samplers) if not s.params.greedy]
        if rows:
            out[rows] = self._sample_rows(logits[rows], [samplers[i] for i in rows])
        tokens = out.tolist()
        for row, s in enumerate(samplers):
            if s.params.repetition_penalty != 1.0:
                s.history.append(tokens[row])
        return tokens

    @staticmethod
    def _sample_rows(logits: torch.Tensor, samplers: list[SlotSampler]) -> torch.Tensor:
        """Sample one token per row [R, vocab] by inverse CDF: one uniform draw from each request's own
        generator, so a seeded request samples the same tokens whatever else runs in its batch."""
        temps = torch.tensor([s.params.temperature for s in samplers], device=logits.device)
        logits = logits.float() / temps[:, None]
        for row, s in enumerate(samplers):
            p = s.params
            if 0 < p.top_k < logits.shape[-1]:
                kth = torch.topk(logits[row], p.top_k).values[-1]
                logits[row] = logits[row].masked_fill(logits[row] < kth, float("-inf"))
            if p.top_p < 1.0:
                sorted_logits, order = torch.sort(logits[row], descending=True)
                probs = sorted_logits.softmax(-1)
                drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix reaching top_p
                logits[row] = logits[row].masked_fill(
                    torch.zeros_like(drop).scatter(0, order, drop), float("-inf")
                )
        cdf = logits.softmax(-1).cumsum(-1)
        uniform = torch.cat([torch.rand(1, generator=s.generator) for s in samplers]).to(cdf.device)
        picks = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)
        return picks.clamp_(max=logits.shape[-1] - 1)

    # ---- entry points --------------------------------------------------------------------------------------

    def step(
        self,
        prefill_slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        decode_slots: Sequence[int],
        tokens: Sequence[int],
        positions: Sequence[int],
        prefixes: Sequence[tuple[int, int]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """Prefill prompts into their slots and decode one token for other slots, in one pass.

        A prompt whose first tokens some slot's cache holds (`prefixes`, default `plan_prefixes`) prefills
        only the rest, after copying those positions from that slot when it is another one. Returns the
        prompts' first new tokens and the decode slots' next tokens.
        """
        prefill = decode = None
        if prompts:
            if prefixes is None:
                prefixes = self.plan_prefixes(prefill_slots, prompts)
            starts = [n for _, n in prefixes]
            for slot, (source, n) in zip(prefill_slots, prefixes, strict=True):
                if source != slot and n:
                    self.copy_prefix(source, slot, n)
            bucket = pick_bucket(
                self.prefill_buckets, max(len(p) - a for p, a in zip(prompts, starts, strict=True))
            )
            padded = torch.zeros((len(prompts), bucket), dtype=torch.long)
            at = torch.full((len(prompts), bucket), self.max_seq_len, dtype=torch.long)
            for row, (ids, a) in enumerate(zip(prompts, starts, strict=True)):
                padded[row, : len(ids) - a] = torch.tensor(ids[a:], dtype=torch.long)
                at[row, : len(ids) - a] = torch.arange(a, len(ids))
            prefill = PrefillBatch(
                tokens=padded.to(self.device),
                last_index=torch.tensor(
                    [len(p) - a - 1 for p, a in zip(prompts, starts, strict=True)], device=self.device
                ),
                slot_ids=torch.tensor(list(prefill_slots), dtype=torch.long, device=self.device),
                positions=at.to(self.device) if any(starts) else None,
            )
        if decode_slots:
            batch = pick_bucket(self.batch_buckets, max(decode_slots) + 1)
            length = pick_bucket(self.decode_buckets, max(positions) + 1)
            tok = [0] * batch
            pos = [self.max_seq_len] * batch  # idle rows write the scratch column
            for s, t, p in zip(decode_slots, tokens, positions, strict=True):
                tok[s], pos[s] = t, p
            decode = self._decode_batch(
                torch.tensor(tok, dtype=torch.long, device=self.device),
                torch.tensor(pos, dtype=torch.long, device=self.device),
                length,
                torch.tensor(list(decode_slots), dtype=torch.long, device=self.device),
            )
        if prefill is None and decode is None:
            return [], []
        try:
            prefill_logits, decode_logits = self.forward(prefill, decode)
        except BaseException:
            self.cached = [[] for _ in range(self.slots)]  # what the cache holds is unknown now
            raise
        for slot, ids in zip(prefill_slots, prompts, strict=True):
            self.cached[slot] = list(ids)
        for slot, token, position in zip(decode_slots, tokens, positions, strict=True):
            held = self.cached[slot]
            if len(held) == position:
                held.append(token)
            else:  # not the continuation of what the slot holds: trust none of it
                held.clear()
        logits = [t for t in (prefill_logits, decode_logits) if t is not None]
        sampled = self.sample(
            torch.cat(logits) if len(logits) > 1 else logits[0], [*prefill_slots, *decode_slots]
        )
        return sampled[: len(prompts)], sampled[len(prompts) :]

    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[int]:
        """Run prompts into their slots, padded to one length bucket; returns their first new tokens."""
        return self.step(slots, prompts, (), (), ())[0]

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> list[int]:
        """One decode step for the given slots (token at position each); returns their next tokens."""
        return self.step((), (), slots, tokens, positions)[1]
