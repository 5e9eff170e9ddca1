"""Reads a safetensors file into tensors that each own their memory.

The format (huggingface/safetensors README, "Format"; the files safetensors 0.8.0 writes): an 8-byte
little-endian header size N, N bytes of JSON ({name: {"dtype", "shape", "data_offsets": [begin, end]},
optional "__metadata__"}), then the data, offsets relative to its start, little-endian, C order.
safetensors' own `safe_open` (0.8.0) maps the whole file and hands out views of that mapping: a single kept
view (a norm of a quantized model) keeps every page of the file that loading read resident, about the size
of the file. Read here, each tensor is its own allocation and the file's pages are never part of the process.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from neuronfleet.runtime.model.model_config import ModelLoadError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
# the limit safetensors' own reader sets (safetensors/src/tensor.rs, MAX_HEADER_SIZE)
MAX_HEADER_BYTES = 100_000_000


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, read into fresh CPU memory."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            (size,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
            if not 0 < size <= MAX_HEADER_BYTES:
                raise ModelLoadError(f"{path} is not a safetensors file (no header)")
            header = json.loads(f.read(size))
            start = 8 + size
            out = {}
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                dtype = DTYPES.get(entry.get("dtype"))
                if dtype is None:
                    known = ", ".join(DTYPES)
                    raise ModelLoadError(
                        f"{path}: tensor {name!r} has dtype {entry.get('dtype')!r}, not one of {known}"
                    )
                begin, end = entry["data_offsets"]
                tensor = torch.empty(entry["shape"], dtype=dtype)
                if tensor.numel() * dtype.itemsize != end - begin:
                    shape = f"{entry['shape']} {entry['dtype']}"
                    raise ModelLoadError(
                        f"{path}: tensor {name!r}'s {end - begin} bytes do not fit its shape {shape}"
                    )
                f.seek(start + begin)
                view = memoryview(tensor.view(-1).view(torch.uint8).numpy()) if end > begin else b""
                if end > begin and f.readinto(view) != end - begin:
                    raise ModelLoadError(f"{path} is cut short in tensor {name!r}")
                out[name] = tensor
            return out
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
