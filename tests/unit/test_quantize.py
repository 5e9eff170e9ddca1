"""Weight-only int8/int4 (runtime/model/quantize.py) and dtype `auto` (runtime/model/dtypes.py): torch's
packed kernels multiply like the stored weights, a quantized folder holds only the packed form and loads as
stored, clear refusals, and the real model's perplexity and chat answers with each."""

from __future__ import annotations

import json
import math
import platform
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from support import make_tiny_llama

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import Engine
from neuronfleet.runtime.engine.model_runner import ModelRunner
from neuronfleet.runtime.model.dtypes import resolve_dtype, resolve_weights_dtype
from neuronfleet.runtime.model.llama import PrefillBatch
from neuronfleet.runtime.model.model_config import ModelLoadError
from neuronfleet.runtime.model.quantize import (
    CONFIG_KEY,
    GROUP_SIZE,
    HEAD_WIDEN_FROM_ROWS,
    Int4Linear,
    Int8Linear,
    quantize_folder,
    quantize_int4,
    quantize_int8,
)
from neuronfleet.runtime.serving.sampling_params import SamplingParams
from neuronfleet.runtime.serving.tokenizer import Tokenizer

TEXT = Path(__file__).parent.parent / "data" / "perplexity_text.txt"


def dequantized(stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float weight a stored int8/int4 form stands for, computed here from the stored tensors."""
    q = stored["qweight"]
    if "scales" in stored:
        return q.float() * stored["scales"][:, None]
    n = q.shape[0]
    values = torch.stack((q & 0x0F, q >> 4), dim=-1).view(n, -1).float()  # feature 2j low, 2j+1 high
    scale, zero = stored["scales_zeros"].unbind(-1)  # [N, K / group]
    return ((values.view(n, scale.shape[1], -1) - 8) * scale[..., None] + zero[..., None]).view(n, -1)


def assert_kernel_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """bfloat16 activations into the kernel: a few bfloat16 roundings of the largest output."""
    torch.testing.assert_close(y, ref, rtol=0, atol=0.02 * float(ref.abs().max()))


def test_int8_layer_multiplies_like_its_per_channel_weights():
    torch.manual_seed(0)
    w, x, bias = torch.randn(96, 128) * 0.05, torch.randn(5, 128), torch.randn(96)
    stored = quantize_int8(w)
    assert stored["qweight"].dtype == torch.int8 and stored["scales"].shape == (96,)
    assert float((dequantized(stored) - w).abs().max()) <= float(stored["scales"].max()) / 2 + 1e-6
    y = Int8Linear(stored["qweight"], stored["scales"], bias)(x)
    assert y.dtype == torch.float32
    assert_kernel_close(y, x @ dequantized(stored).T + bias)


@pytest.mark.parametrize("offset", [1, 8, 24])
def test_int8_layer_takes_weights_at_any_offset_in_memory(offset):
    """A safetensors file hands out tensors at their offsets in the file; torch's AVX512 int8 kernel (16+
    rows) dies of a segmentation fault on a weight not on a 16-byte boundary, so the layer must align it."""
    torch.manual_seed(4)
    stored = quantize_int8(torch.randn(256, 128) * 0.05)
    buffer = torch.empty(stored["qweight"].numel() + offset, dtype=torch.int8)
    shifted = buffer[offset:].view(256, 128)
    shifted.copy_(stored["qweight"])
    x = torch.randn(32, 128)
    y = Int8Linear(shifted, stored["scales"], None)(x)
    assert_kernel_close(y, x @ dequantized(stored).T)


@pytest.mark.parametrize("rows", [3, 16, 40])
def test_an_lm_head_widened_in_blocks_for_many_rows_multiplies_like_its_weights(rows, monkeypatch):
    """From `widen_from_rows` rows on, the head multiplies in bfloat16 blocks of output channels: every
    block, the last short one too, lands in its columns, scaled per channel, with the bias."""
    torch.manual_seed(5)
    monkeypatch.setattr(Int8Linear, "WIDEN_ELEMENTS", 48 * 128)  # blocks of 48 channels: 2 whole, 1 short
    w, x, bias = torch.randn(120, 128) * 0.05, torch.randn(rows, 128), torch.randn(120)
    stored = quantize_int8(w)
    for dtype in (torch.float32, torch.bfloat16):  # the model's dtype, its bias's too
        head = Int8Linear(stored["qweight"], stored["scales"], bias.to(dtype), widen_from_rows=16)
        assert head.block == 48
        y = head(x.to(dtype))
        assert y.shape == (rows, 120) and y.dtype == dtype
        assert_kernel_close(y.float(), x.to(dtype).float() @ dequantized(stored).T + bias)
    wide = Int8Linear(stored["qweight"], stored["scales"], bias, widen_from_rows=16)(x)
    narrow = Int8Linear(stored["qweight"], stored["scales"], bias)(x)  # the kernel, at every size
    assert_kernel_close(wide, narrow)


def test_int4_layer_multiplies_like_its_group_wise_weights_in_this_cpus_layout():
    torch.manual_seed(1)
    w, x = torch.randn(64, 128) * 0.05, torch.randn(7, 128)
    stored = quantize_int4(w)
    assert stored["qweight"].dtype == torch.uint8 and stored["qweight"].shape == (64, 64)
    assert stored["scales_zeros"].shape == (64, 128 // GROUP_SIZE, 2)
    step = float(stored["scales_zeros"][..., 0].max())
    assert float((dequantized(stored) - w).abs().max()) <= step / 2 + 1e-6
    for dtype in (torch.float32, torch.bfloat16):
        y = Int4Linear(stored["qweight"], stored["scales_zeros"], None)(x.to(dtype))
        assert y.dtype == dtype
        assert_kernel_close(y.float(), x.to(dtype).float() @ dequantized(stored).T)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_folder_holds_only_packed_weights_and_loads_them_as_stored(tmp_path, kind):
    folder = make_tiny_llama(tmp_path / "model")
    float_logits = logits_of(ModelRunner(folder, RuntimeConfig(slots=1, max_seq_len=64, dtype="float32")))
    quantize_folder(folder, kind)
    stored = load_file(str(folder / "model.safetensors"))
    assert list(folder.glob("*.safetensors")) == [folder / "model.safetensors"]
    floats = {n for n, t in stored.items() if t.is_floating_point() and not n.endswith(("scales", "zeros"))}
    assert floats and all("norm" in n for n in floats)  # no float weight of a linear layer or the embedding
    assert json.loads((folder / "config.json").read_text())[CONFIG_KEY]["kind"] == kind
    runner = ModelRunner(folder, RuntimeConfig(slots=1, max_seq_len=64, dtype="float32"))
    assert runner.quantization == kind
    for name, layer in (("self_attn.o_proj", "o"), ("mlp.down_proj", "down")):
        parts = {k.rsplit(".", 1)[1]: t for k, t in stored.items() if k.startswith(f"model.layers.1.{name}.")}
        x = torch.randn(3, dequantized(parts).shape[1])
        assert_kernel_close(getattr(runner.model.weights.layers[1], layer)(x), x @ dequantized(parts).T)
    head = {k.rsplit(".", 1)[1]: t for k, t in stored.items() if k.startswith("lm_head.")}
    assert torch.equal(runner.model.weights.lm_head.qweight, head["qweight"])  # int8 in both modes
    # The quantized model still computes the float one's function, within its rounding (random weights have
    # no structure to spare: int4 keeps the direction of the logits, int8 nearly all of them).
    similarity = float(F.cosine_similarity(logits_of(runner), float_logits))
    assert similarity > {"int8": 0.999, "int4": 0.9}[kind]


def logits_of(runner: ModelRunner) -> torch.Tensor:
    tokens = torch.tensor([[5, 17, 99, 3, 250, 42]])
    return runner.model.forward(PrefillBatch(tokens, torch.tensor([5]), torch.tensor([0])), None)[0]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_serving_a_float_folder_quantized_gives_the_stored_forms_logits(tmp_path, kind):
    folder = make_tiny_llama(tmp_path / "float")
    at_load = ModelRunner(folder, RuntimeConfig(slots=1, max_seq_len=64, dtype="float32", quantization=kind))
    shutil.copytree(folder, tmp_path / "stored")
    quantize_folder(tmp_path / "stored", kind)
    stored = ModelRunner(tmp_path / "stored", RuntimeConfig(slots=1, max_seq_len=64, dtype="float32"))
    assert at_load.quantization == stored.quantization == kind
    assert torch.equal(logits_of(at_load), logits_of(stored))


def test_refusals_say_what_is_wrong_and_what_would_work(tmp_path):
    folder = make_tiny_llama(tmp_path / "model")
    quantize_folder(folder, "int4")
    for other in ("int8", "none"):
        with pytest.raises(ModelLoadError, match=r"holds int4 weights .* --quantization int4"):
            ModelRunner(folder, RuntimeConfig(slots=1, max_seq_len=64, quantization=other))
    with pytest.raises(ModelLoadError, match="quantized already"):
        quantize_folder(folder, "int8")
    with pytest.raises(
        ValueError, match=r"quantization 'fp8' is not supported; choose one of none, int8, int4"
    ):
        RuntimeConfig(quantization="fp8")
    odd = make_tiny_llama(tmp_path / "odd", hidden_size=48)  # 48 features: not whole groups of 32
    with pytest.raises(ModelLoadError, match=r"multiple of 32 .* use --quantization int8"):
        ModelRunner(odd, RuntimeConfig(slots=1, max_seq_len=64, quantization="int4"))
    assert (
        ModelRunner(odd, RuntimeConfig(slots=1, max_seq_len=64, quantization="int8")).quantization == "int8"
    )


def cpu_flags() -> set[str] | None:
    """The kernel's CPU flags (independent of torch), on Linux x86; None elsewhere."""
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.is_file():
        return None
    return {f for line in cpuinfo.read_text().splitlines() if line.startswith("flags") for f in line.split()}


def native_bf16_flags() -> bool | None:
    flags = cpu_flags()
    return None if flags is None else bool(flags & {"avx512_bf16", "amx_bf16"})


def cpu_has_native_bf16() -> bool:
    native = native_bf16_flags()
    if native is None:
        caps = torch.cpu.get_capabilities()
        native = bool(caps.get("bf16") or caps.get("sve_bf16"))
    return native


def test_the_lm_head_widens_to_bfloat16_blocks_only_where_the_cpu_multiplies_bfloat16_natively(tmp_path):
    """Emulated (AVX2), the widened head is about 3x slower than the int8 kernel: it keeps the kernel."""
    runner = ModelRunner(
        make_tiny_llama(tmp_path / "q"), RuntimeConfig(slots=1, max_seq_len=64, quantization="int8")
    )
    expected = HEAD_WIDEN_FROM_ROWS if cpu_has_native_bf16() else None
    assert runner.model.weights.lm_head.widen_from_rows == expected


def test_dtype_auto_is_bfloat16_where_the_cpu_has_native_bf16_or_the_weights_are_quantized(tmp_path):
    native = cpu_has_native_bf16()
    expected = "bfloat16" if native else "float32"
    assert resolve_dtype("auto") == expected
    assert [resolve_dtype(d) for d in ("float32", "bfloat16", "float16")] == [
        "float32",
        "bfloat16",
        "float16",
    ]
    runner = ModelRunner(make_tiny_llama(tmp_path / "m"), RuntimeConfig(slots=1, max_seq_len=64))
    assert runner.dtype_name == expected  # RuntimeConfig's default is auto
    assert runner.model.kv_cache.dtype == runner.model.weights.norm.weight.dtype == getattr(torch, expected)
    # Weight-only quantized layers take bfloat16 activations on every CPU: auto serves them in bfloat16 (KV
    # cache included), and an explicit dtype stays as given.
    assert resolve_dtype("auto", quantized=True) == "bfloat16"
    assert resolve_dtype("float32", quantized=True) == "float32"
    quantized = ModelRunner(
        make_tiny_llama(tmp_path / "q"), RuntimeConfig(slots=1, max_seq_len=64, quantization="int8")
    )
    assert quantized.dtype_name == "bfloat16"
    assert quantized.model.kv_cache.dtype == quantized.model.weights.norm.weight.dtype == torch.bfloat16


def test_auto_holds_float_weights_in_float16_where_it_computes_float32_on_an_avx2_x86_cpu(tmp_path):
    """fbgemm's float16-weight GEMM needs AVX2 and F16C (x86); where `auto` is float32 there, the float
    layers' weights are held in float16. An explicit dtype, and quantized layers, keep their own."""
    flags = cpu_flags() or set()
    gemm = {"avx2", "f16c"} <= flags and "fbgemm" in torch.backends.quantized.supported_engines
    expected = "float16" if gemm and not cpu_has_native_bf16() else resolve_dtype("auto")
    assert resolve_weights_dtype("auto") == expected
    assert [resolve_weights_dtype(d) for d in ("float32", "bfloat16", "float16")] == [
        "float32",
        "bfloat16",
        "float16",
    ]
    assert resolve_weights_dtype("auto", quantized=True) == "bfloat16"
    runner = ModelRunner(make_tiny_llama(tmp_path / "m"), RuntimeConfig(slots=1, max_seq_len=64))
    assert (runner.dtype_name, runner.weights_dtype_name) == (resolve_dtype("auto"), expected)


# ---- the real model ---------------------------------------------------------------------------------------


def perplexity(model_dir: Path, dtype: str, quantization: str) -> float:
    runner = ModelRunner(
        model_dir, RuntimeConfig(slots=1, max_seq_len=512, dtype=dtype, quantization=quantization)
    )
    ids = Tokenizer(model_dir).encode(TEXT.read_text())
    assert 300 < len(ids) < 512
    every = torch.arange(len(ids) - 1)[None]  # the logits after every token but the last
    logits = runner.model.forward(PrefillBatch(torch.tensor([ids]), every, torch.tensor([0])), None)[0]
    return math.exp(float(F.cross_entropy(logits.float(), torch.tensor(ids[1:]))))


@pytest.mark.real_model
def test_perplexity_of_int8_and_int4_stays_near_bfloat16(smollm2_dir, capsys):
    bf16 = perplexity(smollm2_dir, "bfloat16", "none")
    int8 = perplexity(smollm2_dir, "bfloat16", "int8")
    int4 = perplexity(smollm2_dir, "bfloat16", "int4")
    with capsys.disabled():
        print(f"\nperplexity on {TEXT.name}: bfloat16 {bf16:.3f}, int8 {int8:.3f}, int4 {int4:.3f}")
    assert 5 < bf16 < 60  # the model reads English prose: far below the vocabulary's 49152
    assert abs(int8 / bf16 - 1) <= 0.02
    assert abs(int4 / bf16 - 1) <= 0.06


@pytest.mark.real_model
def test_perplexity_of_float16_held_weights_stays_at_float32s(smollm2_dir, capsys, float16_weights):
    """`auto` on a CPU without native bfloat16: float32 activations on float16-held weights."""
    exact = perplexity(smollm2_dir, "float32", "none")
    held = perplexity(smollm2_dir, "auto", "none")
    with capsys.disabled():
        print(f"\nperplexity on {TEXT.name}: float32 {exact:.3f}, float16-held weights {held:.3f}")
    assert 5 < exact < 60
    assert abs(held / exact - 1) <= 0.002


@pytest.mark.real_model
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_engine_answers_chat_questions_sensibly(smollm2_dir, kind):
    engine = Engine.from_model_dir(
        str(smollm2_dir), RuntimeConfig(slots=4, max_seq_len=256, quantization=kind)
    )
    # Questions the float model answers right, and the word its answer holds. Not "the capital of France":
    # there the float model's first token is "The" by 0.08 of a logit over "L" (25.33 / 25.24), a coin that
    # int4 (and bucket padding) may flip into a French sentence.
    asks = {
        "What is the capital of Japan?": "Tokyo",
        "Say hello in Spanish.": "Hola",
        "What color is the sky on a clear day?": "blue",
        "Name three fruits.": "banana",
    }
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in asks]
    outs = engine.generate(prompts, SamplingParams(max_tokens=48))
    for (question, word), out in zip(asks.items(), outs, strict=True):
        assert word.lower() in out.text.lower(), (question, out.text)
        assert "<|im_end|>" not in out.text
    alone = engine.generate(prompts[:1], SamplingParams(max_tokens=48))[0]
    assert alone.token_ids == outs[0].token_ids  # a row's tokens do not depend on the batch around it
