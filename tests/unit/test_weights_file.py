"""runtime/model/weights_file.py against the safetensors library (0.8.0) that wrote the files: the same
tensors for every dtype a checkpoint holds, clear refusals of what is not such a file, and a loaded model that
keeps no mapping of its weights file."""

from __future__ import annotations

import platform
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import make_tiny_llama

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.model_runner import ModelRunner
from neuronfleet.runtime.model.model_config import ModelLoadError
from neuronfleet.runtime.model.quantize import quantize_folder
from neuronfleet.runtime.model.weights_file import read_tensors


def test_every_dtype_reads_as_the_library_wrote_it(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5), "bf16": torch.randn(7, 2).bfloat16(), "f16": torch.randn(4).half(),
        "f64": torch.randn(2, 2, 2).double(), "i64": torch.arange(-3, 9), "i32": torch.arange(6).int(),
        "i16": torch.tensor([-2, 7], dtype=torch.int16), "i8": torch.tensor([[-128, 127]], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
    }  # fmt: skip
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    read, reference = read_tensors(path), load_file(str(path))
    assert read.keys() == reference.keys() == tensors.keys()
    for name, tensor in reference.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape, name
        assert torch.equal(read[name], tensor), name


def test_a_real_checkpoint_reads_as_the_library_reads_it(tmp_path):
    folder = make_tiny_llama(tmp_path / "model")
    (path,) = folder.glob("*.safetensors")
    read, reference = read_tensors(path), load_file(str(path))
    assert read.keys() == reference.keys()
    assert all(torch.equal(read[n], reference[n]) for n in reference)


def test_what_is_not_a_whole_safetensors_file_is_refused_with_what_is_wrong(tmp_path):
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a safetensors file"):
        read_tensors(empty)
    text = tmp_path / "text.safetensors"
    text.write_text("this is no header at all")
    with pytest.raises(ModelLoadError, match="not a safetensors file"):
        read_tensors(text)
    path = tmp_path / "cut.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(path))
    whole = path.read_bytes()
    path.write_bytes(whole[:-100])
    with pytest.raises(ModelLoadError, match="cut short in tensor 'w'"):
        read_tensors(path)
    odd = tmp_path / "odd.safetensors"
    header = b'{"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}}'
    odd.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    with pytest.raises(ModelLoadError, match="dtype 'F8_E4M3', not one of"):
        read_tensors(odd)
    bad = tmp_path / "bad.safetensors"
    header = b'{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}'
    bad.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(ModelLoadError, match="8 bytes do not fit its shape"):
        read_tensors(bad)


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/maps")
@pytest.mark.parametrize("kind", ["none", "int4"])
def test_a_loaded_model_keeps_no_mapping_of_its_weights_file(tmp_path, kind):
    """safetensors' own reader hands out views of a mapping of the whole file: one kept norm kept every page
    loading had read resident (105 MiB of SmolLM2 int4)."""
    folder = make_tiny_llama(tmp_path / "model")
    if kind != "none":
        quantize_folder(folder, kind)
    runner = ModelRunner(folder, RuntimeConfig(slots=1, max_seq_len=64, dtype="float32"))
    assert runner.model.weights.layers
    mapped = Path("/proc/self/maps").read_text()
    assert str(folder) not in mapped
