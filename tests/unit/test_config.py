"""The runtime configuration: validated once, buckets derived, checked against the model (pure; no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from neuronfleet.runtime.engine.config import RuntimeConfig, default_length_buckets, pick_bucket
from neuronfleet.runtime.model.model_config import parse_model_config

MODEL = parse_model_config(
    {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
    }
)


def test_config_imports_no_torch():
    code = (
        "import sys, neuronfleet.runtime.engine.config; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True)


def test_unset_buckets_are_derived_from_max_seq_len():
    c = RuntimeConfig(slots=6, max_seq_len=256)
    assert c.prefill_buckets == tuple(default_length_buckets(256, 1, 4))  # on CPU
    assert c.decode_buckets == tuple(default_length_buckets(256, 64, 2)) == (64, 96, 128, 192, 256)
    assert c.max_prompt_len == 256
    assert c.batch_buckets == [1, 2, 4, 6]
    assert c.max_prefill_tokens == 2048  # the default budget, above the largest prompt bucket


def test_cpu_prefills_pad_a_few_new_tokens_to_a_few_rows():
    """On CPU a shape costs nothing, so a prompt whose cached prefix is reused prefills about its new tokens
    (a compiling device keeps 16 as its smallest shape)."""
    cpu = RuntimeConfig(slots=4, max_seq_len=512)
    assert [pick_bucket(cpu.prefill_buckets, n) for n in (1, 3, 9, 13, 17)] == [1, 3, 10, 14, 20]
    assert RuntimeConfig(slots=4, max_seq_len=512, device="neuron").prefill_buckets[0] == 16


def test_max_input_len_bounds_the_prompt_and_the_derived_prefill_buckets():
    c = RuntimeConfig(max_seq_len=512, max_input_len=384)
    assert c.prefill_buckets == tuple(default_length_buckets(384, 1, 4)) and c.prefill_buckets[-1] == 384
    assert c.decode_buckets[-1] == 512
    assert c.max_prompt_len == 384
    assert RuntimeConfig(max_seq_len=512, max_input_len=384, prefill_buckets=[128, 384]).max_prompt_len == 384


def test_given_buckets_are_sorted_and_deduplicated_and_bound_the_prompt():
    c = RuntimeConfig(max_seq_len=256, prefill_buckets=[128, 32, 32], decode_buckets=[256, 128])
    assert c.prefill_buckets == (32, 128) and c.decode_buckets == (128, 256)
    assert c.max_prompt_len == 128
    assert RuntimeConfig(max_seq_len=4096, max_prefill_tokens=512).max_prefill_tokens == 4096  # never below


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"slots": 0}, r"slots must be at least 1, got 0 \(--slots\)"),
        ({"max_seq_len": 0}, r"max_seq_len must be at least 1, got 0 \(--max-seq-len\)"),
        ({"dtype": "int8"}, r"dtype 'int8' is not supported; choose one of auto, float32, bfloat16, float16"),
        ({"max_waiting": -1}, r"max_waiting must be at least 0"),
        (
            {"max_seq_len": 32, "prefill_buckets": [16, 64]},
            r"prefill buckets \[16, 64\] must be between 1 and max_seq_len \(32\) \(--prefill-buckets\)",
        ),
        ({"max_seq_len": 32, "decode_buckets": [0, 32]}, r"decode buckets .* between 1 and max_seq_len"),
        (
            {"max_seq_len": 256, "max_input_len": 300},
            r"max_input_len must be between 1 and max_seq_len \(256\), got 300 \(--max-input-len\)",
        ),
        (
            {"max_seq_len": 256, "max_input_len": 192, "prefill_buckets": [64, 128]},
            r"largest prefill bucket must equal max_input_len \(192\), got 128 \(--prefill-buckets\)",
        ),
        (
            {"max_seq_len": 256, "decode_buckets": [64, 128]},
            r"largest decode bucket must equal max_seq_len \(256\), got 128 \(--decode-buckets\)",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_flag_and_what_would_be_right(settings, message):
    with pytest.raises(ValueError, match=message):
        RuntimeConfig(**settings)


def test_a_length_the_model_cannot_hold_is_refused():
    assert RuntimeConfig(max_seq_len=512).check_model(MODEL).max_seq_len == 512
    with pytest.raises(ValueError, match=r"max_seq_len 1024 .* max_position_embeddings \(512\)"):
        RuntimeConfig(max_seq_len=1024).check_model(MODEL)
