"""A copy of a GGUF file made for a test: its first layers only, its tensors requantized (with
llama.cpp's own GGUF package) or as they are.

NOTE: a conversion's cost (GenAI's reader, the weight checks, the rewrite and its probe)
grows with the layers, and tests of the conversion are about one layer's tensors as much as
thirty's: the embedded SmolLM2 cut to two layers converts three times faster. The metadata
is copied as bytes: the GGUF package's reader takes seconds over the 49,152 tokens."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

# A tensor's (name, ggml type, data: rows of bytes) -> its (type, data) in the copy.
Retype = Callable[[str, int, np.ndarray], tuple[int, np.ndarray]]
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def u(self, size: int) -> int:
        value = int.from_bytes(self.data[self.pos:self.pos + size], "little")
        self.pos += size
        return value

    def string(self) -> str:
        n = self.u(8)
        self.pos += n
        return self.data[self.pos - n:self.pos].decode()

    def skip(self, kind: int) -> None:
        if kind == _STRING:
            n = self.u(8)
            self.pos += n
        elif kind == _ARRAY:
            item, n = self.u(4), self.u(8)
            if item in _SCALARS:
                self.pos += _SCALARS[item] * n
            else:
                for _ in range(n):
                    self.skip(item)
        else:
            self.pos += _SCALARS[kind]


def copy_gguf(source: Path, target: Path, layers: int | None = None,
              retype: Retype | None = None, file_type: int | None = None) -> Path:
    """`source` (a little-endian GGUF v3 file) written to `target` with only its first
    `layers` blocks (its block count said so; all when None), each tensor through `retype`
    and `general.file_type` set to `file_type` when given; every other field as it is.
    Returns `target`."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = source.read_bytes()
    src = _Bytes(raw)
    assert raw[:4] == b"GGUF" and struct.unpack_from("<I", raw, 4)[0] == 3, source
    src.pos = 8
    count, kv_count = src.u(8), src.u(8)
    kv = bytearray()
    align = 32
    for _ in range(kv_count):
        start = src.pos
        key = src.string()
        kind = src.u(4)
        value_at = src.pos
        src.skip(kind)
        field = bytearray(raw[start:src.pos])
        at = value_at - start
        if kind == _UINT32 and key.endswith(".block_count") and layers is not None:
            field[at:at + 4] = struct.pack("<I", layers)
        elif kind == _UINT32 and key == "general.file_type" and file_type is not None:
            field[at:at + 4] = struct.pack("<I", file_type)
        elif key == "general.alignment":
            align = int.from_bytes(raw[value_at:src.pos], "little")
        kv += field
    tensors = []
    for _ in range(count):
        name = src.string()
        dims = [src.u(8) for _ in range(src.u(4))]
        kind, offset = src.u(4), src.u(8)
        tensors.append((name, dims, kind, offset))
    data_at = -(-src.pos // align) * align
    table, blobs, at = bytearray(), [], 0
    for name, dims, kind, offset in tensors:
        if layers is not None and name.startswith("blk.") and int(name.split(".")[1]) >= layers:
            continue
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        rows = int(np.prod(dims[1:]))
        start = data_at + offset
        data = np.frombuffer(raw, np.uint8, rows * dims[0] // block * size, start)
        data = data.reshape(rows, -1)
        if retype is not None:
            kind, data = retype(name, kind, data)
        encoded = name.encode()
        table += struct.pack("<Q", len(encoded)) + encoded + struct.pack("<I", len(dims))
        table += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", kind, at)
        blob = np.ascontiguousarray(data).tobytes()
        blobs.append(blob + bytes(-len(blob) % align))
        at += len(blobs[-1])
    head = b"GGUF" + struct.pack("<IQQ", 3, len(blobs), kv_count) + bytes(kv) + bytes(table)
    with target.open("wb") as f:
        f.write(head + bytes(-len(head) % align))
        for blob in blobs:
            f.write(blob)
    return target
