"""Loading model folders: supported Llama-family configs, clear errors for what the runtime cannot serve."""

from __future__ import annotations

import json
import shutil

import pytest
from support import make_tiny_llama

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.model_runner import ModelRunner
from neuronfleet.runtime.model.model_config import ModelLoadError, load_model_config, parse_model_config

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_defaults_and_eos_ids_from_config_and_generation_config():
    cfg = parse_model_config({**BASE, "eos_token_id": 2}, {"eos_token_id": [2, 7]})
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16 and cfg.rope_theta == 10000.0
    assert cfg.eos_token_ids == (2, 7)
    assert cfg.rope_scaling.rope_type == "default"


def test_rope_scaling_in_both_spellings():
    old = parse_model_config(
        {
            **BASE,
            "rope_theta": 5e5,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    new = parse_model_config(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}
    )
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling.rope_type == new.rope_scaling.rope_type == "llama3"
    assert old.rope_scaling.factor == new.rope_scaling.factor == 8.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "architecture 'GPT2LMHeadModel' is not supported.*LlamaForCausalLM",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn' is not supported"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_configs_are_refused_by_name(change, message):
    raw = {**BASE, **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ModelLoadError, match=message):
        parse_model_config(raw)


def test_missing_folder_files_and_tensors_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_config(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match=r"lacks config\.json"):
        load_model_config(tmp_path)
    model = make_tiny_llama(tmp_path / "m")
    broken = tmp_path / "no-weights"
    broken.mkdir()
    shutil.copy(model / "config.json", broken / "config.json")
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors weights"):
        load_model_config(broken)
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_hidden_layers"] = 3  # the checkpoint has only two layers
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"lack tensor 'model.layers.2.input_layernorm.weight'"):
        ModelRunner(model, RuntimeConfig(slots=1, max_seq_len=32))


def test_runner_refuses_settings_the_model_cannot_serve(tmp_path):
    model = make_tiny_llama(tmp_path)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelRunner(model, RuntimeConfig(slots=1, max_seq_len=4096))
