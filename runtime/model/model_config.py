"""Reads a Hugging Face-format model folder's `config.json` into the Llama-family shape the runtime serves.

Pure (no torch): the engine, the operator's fit estimate and the CLI read the same facts from here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(ValueError):
    """A model folder the runtime cannot serve; the message says what is missing or unsupported."""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary embedding frequency scaling, as Hugging Face configs spell it."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder-only model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    sliding_window: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"


def _ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)  # type: ignore[union-attr]


def _rope_scaling(raw: dict) -> tuple[float, RopeScaling]:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older configs `rope_scaling`.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, RopeScaling()
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def parse_model_config(raw: dict, generation: dict | None = None) -> ModelConfig:
    """Build a ModelConfig from a config.json dict (and generation_config.json, for the EOS ids)."""
    architectures = raw.get("architectures") or []
    architecture = architectures[0] if architectures else raw.get("model_type", "<none>")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; the runtime serves Llama-family models "
            f"({', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(
            f"hidden_act {raw['hidden_act']!r} is not supported; Llama-family models use 'silu'"
        )
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        theta, scaling = _rope_scaling(raw)
        eos = _ids(raw.get("eos_token_id"))
        if generation:
            eos = tuple(dict.fromkeys(eos + _ids(generation.get("eos_token_id"))))
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            sliding_window=raw.get("sliding_window") or None,
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks the required field {e.args[0]!r}") from None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and check a model folder: config.json and safetensors weights must be there."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(
            f"model folder {path} does not exist; import one with `neuronfleet model import-gguf`"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {path} lacks config.json; a Hugging Face-format folder needs it")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(
            f"model folder {path} has no *.safetensors weights; convert .bin checkpoints to safetensors first"
        )
    raw = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return parse_model_config(raw, generation)
