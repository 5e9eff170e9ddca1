"""A GGUF file's metadata and tensor index, read straight from its bytes (the format: magic `GGUF`, version,
tensor and key/value counts, the typed key/values, the tensor infos, then the tensors at the file's
alignment). gguf-py's `GGUFReader` makes a memory-mapped array view of every element of every metadata
array, which for a 49152-token vocabulary and its merges is most of an import's time; this reads each array
at once. The tensors stay views of one read-only memory map, typed as `gguf.quants.dequantize` takes them."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

V, Q = GGUFValueType, GGMLQuantizationType
_SCALARS = {
    V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
    V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d",
}  # fmt: skip
_FLOATS = {
    Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16, Q.I32: np.int32,
    Q.I64: np.int64,
}  # fmt: skip


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUF lists it: innermost dimension first
    n_bytes: int
    data: np.ndarray  # elements (float and integer types) or bytes per row (quantized types)


class GGUFFile:
    """`fields` (key -> value: int, float, bool, str, or a list of them) and `tensors`, in file order."""

    def __init__(self, path: str | Path) -> None:
        self._map = np.memmap(path, mode="r")
        self._buf = memoryview(self._map)
        self._at = 0
        if bytes(self._buf[:4]) != MAGIC:
            raise ValueError(f"not a GGUF file (it starts with {bytes(self._buf[:4])!r}, not {MAGIC!r})")
        self._at = 4
        version = self._scalar(GGUFValueType.UINT32)
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (this reader reads {VERSIONS})")
        n_tensors, n_fields = self._scalar(GGUFValueType.UINT64), self._scalar(GGUFValueType.UINT64)
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(GGUFValueType(self._scalar(GGUFValueType.UINT32)))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(
                self._scalar(GGUFValueType.UINT64) for _ in range(self._scalar(GGUFValueType.UINT32))
            )
            kind = GGMLQuantizationType(self._scalar(GGUFValueType.UINT32))
            infos.append((name, dims, kind, self._scalar(GGUFValueType.UINT64)))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._at // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("the GGUF file names a tensor twice")

    def _scalar(self, kind: GGUFValueType) -> Any:
        fmt = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self._buf, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar(GGUFValueType.UINT64)
        text = bytes(self._buf[self._at : self._at + n]).decode("utf-8", errors="replace")
        self._at += n
        return text

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind != GGUFValueType.ARRAY:
            return self._scalar(kind)
        item, n = GGUFValueType(self._scalar(GGUFValueType.UINT32)), self._scalar(GGUFValueType.UINT64)
        if item in _SCALARS:  # a whole array at once
            dtype = np.dtype(_SCALARS[item])
            values = np.frombuffer(self._buf, dtype, count=n, offset=self._at)
            self._at += n * dtype.itemsize
            return values.tolist()
        return [self._value(item) for _ in range(n)]

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, offset: int):
        block, size = GGML_QUANT_SIZES[kind]
        n_elements = int(np.prod(dims)) if dims else 1
        n_bytes = n_elements * size // block
        shape = tuple(reversed(dims))
        if kind in _FLOATS:
            data = np.frombuffer(self._map, _FLOATS[kind], count=n_elements, offset=start + offset).reshape(
                shape
            )
        else:
            data = np.frombuffer(self._map, np.uint8, count=n_bytes, offset=start + offset)
            data = data.reshape(quant_shape_to_byte_shape(shape, kind))
        return Tensor(name, kind, dims, n_bytes, data)
