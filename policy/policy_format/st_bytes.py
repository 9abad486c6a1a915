"""safetensors bytes of host arrays with one copy: what `safetensors.numpy.save` returns, at a quarter of its CPU.

`safetensors.numpy.save` copies every array twice (`tobytes`, then into the serialised buffer) and faults in two
fresh buffers of the file's size: 1.1 CPU s for a ~50M model's 553 MB checkpoint on the 2-core VM, where this
takes one `bytes.join` of the header and the arrays' own memory (docs/benchmarks.md "rlpipe vs TRL").
The file is the format safetensors reads (`safetensors.numpy.load`, `safe_open`): an 8-byte little-endian header
length, a JSON header (each tensor's dtype, shape and `data_offsets`, and `__metadata__`) padded with spaces to a
multiple of 8, then the tensors' little-endian bytes back to back in the header's order.
"""

from __future__ import annotations

import json
import struct

import numpy as np

SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "uint64": "U64", "int32": "I32", "uint32": "U32", "int16": "I16", "uint16": "U16",
    "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}  # fmt: skip
"""numpy dtype name (ml_dtypes' for bfloat16 and float8) -> the safetensors dtype code."""


def save(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors file of `tensors` (name -> host array) with `metadata` in its header, as bytes: readable by
    `safetensors.numpy.load` and `safe_open` with the same names, dtypes, shapes, values and metadata as
    `safetensors.numpy.save` gives. ValueError names a tensor whose dtype safetensors has no code for."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pieces: list[memoryview] = []
    offset = 0
    for name, array in tensors.items():
        code = SAFETENSORS_DTYPES.get(array.dtype.name)
        if code is None:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype.name} has no safetensors code")
        if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and not np.little_endian):
            array = array.byteswap().view(array.dtype.newbyteorder("<"))
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)  # no copy for a contiguous array
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + flat.size]}
        pieces.append(memoryview(flat.data))
        offset += flat.size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return b"".join([struct.pack("<Q", len(text)), text, *pieces])
