"""A CTranslate2 `model.bin`, read with numpy alone (no ctranslate2 package).

The layout is CTranslate2's own serializer (python/ctranslate2/specs/model_spec.py
`ModelSpec._serialize`, binary version 6), all little-endian:

    u32 version, string spec name, u32 spec revision, u32 variable count,
    per variable: string name, u8 rank, u32 dims[rank], u8 dtype, u32 byte count, the bytes;
    u32 alias count, per alias: string alias, string name of the variable it repeats.

A string is a u16 length (with the NUL), the UTF-8 bytes and a NUL. The dtype numbers follow
CTranslate2's `DataType` enum: float32, int8, int16, int32, float16, bfloat16.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_VERSIONS = (5, 6)
_DTYPES: tuple[Any, ...] = (np.float32, np.int8, np.int16, np.int32, np.float16, None)
_DTYPE_NAMES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")


class CT2FormatError(ValueError):
    """The file is not a CTranslate2 model.bin this reader understands."""


@dataclass(frozen=True)
class CT2Model:
    spec: str  # e.g. "WhisperSpec"
    revision: int
    # Name -> array; an alias (a tied weight) maps to the same array as its target.
    variables: dict[str, np.ndarray[Any, Any]]

    def scalar(self, name: str) -> int:
        return int(self.variables[name].reshape(()))


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, size: int) -> bytes:
        if self.at + size > len(self.data):
            raise CT2FormatError(f"truncated at byte {self.at} (wanted {size} more)")
        chunk = self.data[self.at:self.at + size]
        self.at += size
        return chunk

    def uint(self, code: str) -> int:
        size = struct.calcsize(code)
        return int(struct.unpack("<" + code, self.take(size))[0])

    def string(self) -> str:
        size = self.uint("H")
        if size < 1:
            raise CT2FormatError(f"empty string record at byte {self.at}")
        return self.take(size)[:-1].decode("utf-8")


def read_model_bin(path: Path) -> CT2Model:
    """Every variable of a CTranslate2 model.bin (float16 stays float16). NOTE: the arrays are
    views of one bytes object read whole: a Whisper tiny file is 75 MB."""
    reader = _Reader(Path(path).read_bytes())
    version = reader.uint("I")
    if version not in SUPPORTED_VERSIONS:
        raise CT2FormatError(f"{path}: binary version {version}, not one of "
                             f"{SUPPORTED_VERSIONS}")
    spec = reader.string()
    revision = reader.uint("I")
    variables: dict[str, np.ndarray[Any, Any]] = {}
    for _ in range(reader.uint("I")):
        name = reader.string()
        shape = [reader.uint("I") for _ in range(reader.uint("B"))]
        type_id = reader.uint("B")
        size = reader.uint("I")
        if type_id >= len(_DTYPES) or _DTYPES[type_id] is None:
            label = _DTYPE_NAMES[type_id] if type_id < len(_DTYPE_NAMES) else str(type_id)
            raise CT2FormatError(f"{path}: {name} has dtype {label}, not supported here")
        dtype = np.dtype(_DTYPES[type_id])
        if size != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise CT2FormatError(f"{path}: {name} holds {size} bytes, not {shape} {dtype}")
        start = reader.at
        reader.take(size)
        variables[name] = np.frombuffer(reader.data, dtype, size // dtype.itemsize,
                                        start).reshape(shape)
    for _ in range(reader.uint("I")):
        alias, target = reader.string(), reader.string()
        if target not in variables:
            raise CT2FormatError(f"{path}: alias {alias} names no variable ({target})")
        variables[alias] = variables[target]
    return CT2Model(spec=spec, revision=revision, variables=variables)
