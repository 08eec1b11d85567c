"""The GGUF file header, read in pure Python (format v2/v3, either byte order): its metadata
keys and the tensor count by type, without loading any tensor; and the tensor table (each
tensor's name, dimensions, type and where its data lies), for what reads a tensor's bytes
(workers/generation/gguf_exact.py). Arrays longer than a bound are not materialised (their
length is kept); more than `MAX_METADATA_KEYS` keys or arrays nested deeper than
`MAX_ARRAY_DEPTH` are a GGUFError.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from pathlib import Path

import msgspec

GGUF_MAGIC = b"GGUF"
# NOTE: arrays longer than this (token lists, merges, scores) are not materialised; Ollama
# uses the same cut-off for /api/show without `verbose`.
DEFAULT_MAX_ARRAY_LEN = 1024
# NOTE: a header is a few dozen keys and arrays nest once at most (llama.cpp reads no deeper);
# the bounds keep a hostile file's metadata from growing the reader's memory or its stack.
MAX_METADATA_KEYS = 65_536
MAX_ARRAY_DEPTH = 8
# llama.cpp `enum llama_ftype` (llama.h); 4-6 and 33-35 are retired but may appear in old files.
GGUF_FILE_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 4: "Q4_1_SOME_F16", 5: "Q4_2", 6: "Q4_3",
    7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L",
    14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS",
    20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
    33: "Q4_0_4_4", 34: "Q4_0_4_8", 35: "Q4_0_8_8", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4",
}  # fmt: skip
# ggml `enum ggml_type` (ggml.h), used only when general.file_type is missing.
GGML_TENSOR_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip

# GGUF value types -> struct codes; 8 = string, 9 = array.
_SCALAR_CODES: dict[int, str] = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


class ModelInfoError(Exception):
    """The path is neither a readable GGUF file nor an OpenVINO IR folder."""


class GGUFError(ModelInfoError):
    """The GGUF header is malformed, truncated or of an unsupported version."""


class SkippedArray(msgspec.Struct, frozen=True):
    """Stands in for a GGUF array too long to materialise; its length is kept."""

    item_type: int
    length: int


class GGUFHeader(msgspec.Struct, frozen=True):
    version: int
    tensor_count: int
    metadata: dict[str, object]
    parameter_count: int
    # ggml tensor type -> number of elements stored in that type
    elements_by_type: dict[int, int]


def _shortest_float32(value: float) -> float:
    """1e-05 rather than 9.999999747378752e-06: the shortest decimal that is the same float32."""
    packed = struct.pack("<f", value)
    for digits in range(6, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == packed:
            return candidate
    return value


class GGUFTensor(msgspec.Struct, frozen=True):
    """One tensor of the table: `dims` in ggml's order (dims[0] is a row's length), `offset`
    the first byte of its data in the file."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


# NOTE: the data section starts at the next multiple of general.alignment (32 by default).
DEFAULT_ALIGNMENT = 32


class _Reader:
    def __init__(self, buf: mmap.mmap, endian: str) -> None:
        self.buf, self.pos, self.endian = buf, 0, endian
        self._structs: dict[str, struct.Struct] = {}

    def scalar(self, code: str) -> int | float | bool:
        s = self._structs.get(code)
        if s is None:
            s = self._structs[code] = struct.Struct(self.endian + code)
        try:
            (value,) = s.unpack_from(self.buf, self.pos)
        except struct.error as exc:
            raise GGUFError(f"truncated header at byte {self.pos}") from exc
        self.pos += s.size
        if code == "f":
            return _shortest_float32(value)
        return value  # type: ignore[no-any-return]

    def u32(self) -> int:
        return int(self.scalar("I"))

    def u64(self) -> int:
        return int(self.scalar("Q"))

    def advance(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"truncated header at byte {self.pos} (needs {n} more bytes)")
        self.pos += n

    def string(self) -> str:
        n = self.u64()
        start = self.pos
        self.advance(n)
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int, max_array_len: int, depth: int = 0) -> object:
        if vtype in _SCALAR_CODES:
            return self.scalar(_SCALAR_CODES[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise GGUFError(f"unknown value type {vtype} at byte {self.pos}")
        if depth >= MAX_ARRAY_DEPTH:
            raise GGUFError(f"arrays nested deeper than {MAX_ARRAY_DEPTH} at byte {self.pos}")
        item_type, length = self.u32(), self.u64()
        if length > max_array_len:
            self.skip_items(item_type, length, depth + 1)
            return SkippedArray(item_type, length)
        return [self.value(item_type, max_array_len, depth + 1) for _ in range(length)]

    def skip_items(self, item_type: int, length: int, depth: int) -> None:
        if item_type in _SCALAR_CODES:
            self.advance(struct.calcsize(_SCALAR_CODES[item_type]) * length)
        elif item_type == _STRING:
            u64 = struct.Struct(self.endian + "Q")
            buf, pos, end = self.buf, self.pos, len(self.buf)
            try:
                for _ in range(length):
                    pos += 8 + u64.unpack_from(buf, pos)[0]
            except struct.error as exc:
                raise GGUFError(f"truncated string array at byte {pos}") from exc
            if pos > end:
                raise GGUFError("string array runs past the end of the file")
            self.pos = pos
        elif item_type == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFError(f"arrays nested deeper than {MAX_ARRAY_DEPTH} at byte {self.pos}")
            for _ in range(length):
                self.skip_items(self.u32(), self.u64(), depth + 1)
        else:
            raise GGUFError(f"unknown array item type {item_type} at byte {self.pos}")


def _read(path: Path, max_array_len: int) -> tuple[GGUFHeader, list[GGUFTensor]]:
    """Parse a GGUF v2/v3 header: metadata and the tensor info table, never tensor data."""
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise GGUFError(f"{path}: too small to be a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != GGUF_MAGIC:
                raise GGUFError(f"{path}: bad magic {bytes(buf[:4])!r}")
            # NOTE: a big-endian file stores the version byte-swapped, so its low half is 0.
            (version,) = struct.unpack_from("<I", buf, 4)
            endian = "<"
            if version & 0xFFFF == 0:
                endian = ">"
                (version,) = struct.unpack_from(">I", buf, 4)
            if version not in (2, 3):
                raise GGUFError(f"{path}: unsupported GGUF version {version}")
            r = _Reader(buf, endian)
            r.pos = 8
            tensor_count, kv_count = r.u64(), r.u64()
            if kv_count > MAX_METADATA_KEYS:
                raise GGUFError(f"{path}: {kv_count} metadata keys (at most "
                                f"{MAX_METADATA_KEYS} are read)")
            metadata: dict[str, object] = {}
            for _ in range(kv_count):
                key = r.string()
                metadata[key] = r.value(r.u32(), max_array_len)
            parameters = 0
            by_type: dict[int, int] = {}
            table: list[tuple[str, tuple[int, ...], int, int]] = []
            for _ in range(tensor_count):
                name = r.string()
                n_dims = r.u32()
                if n_dims > 8:
                    raise GGUFError(f"{path}: tensor with {n_dims} dimensions")
                dims = tuple(r.u64() for _ in range(n_dims))
                ggml_type = r.u32()
                table.append((name, dims, ggml_type, r.u64()))
                elements = math.prod(dims)
                parameters += elements
                by_type[ggml_type] = by_type.get(ggml_type, 0) + elements
            align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
            if not isinstance(align, int) or isinstance(align, bool) or align <= 0:
                raise GGUFError(f"{path}: bad general.alignment {align!r}")
            data = -(-r.pos // align) * align
    header = GGUFHeader(version, tensor_count, metadata, parameters, by_type)
    return header, [GGUFTensor(n, d, t, data + o) for n, d, t, o in table]


def read_gguf_header(path: Path, *, max_array_len: int = DEFAULT_MAX_ARRAY_LEN) -> GGUFHeader:
    """Parse a GGUF v2/v3 header: metadata and the tensor info table, never tensor data."""
    return _read(path, max_array_len)[0]


def read_gguf_tensors(path: Path) -> list[GGUFTensor]:
    """The file's tensor table, where each tensor's data lies (not read)."""
    return _read(path, DEFAULT_MAX_ARRAY_LEN)[1]


# The ggml tensor types OpenVINO GenAI's GGUF reader takes (tried with llama-quantize's
# output of the same file: Q5_0, Q5_1, Q5_K, Q2_K, Q3_K, IQ4_NL and BF16 fail in its load
# with "gguf_tensor_to_f16 failed" or "Unsupported quantization type").
READABLE_TENSOR_TYPES = frozenset({0, 1, 2, 3, 8, 12, 14})  # F32 F16 Q4_0 Q4_1 Q8_0 Q4_K Q6_K
READABLE_FILES = "Q4_K_M, Q4_0, Q4_1, Q6_K, Q8_0 or F16"


# The quantisations of a GGUF file's name (llama.cpp's naming: model-Q5_K_M.gguf) whose
# tensors are of types outside READABLE_TENSOR_TYPES: known before a download.
_UNREADABLE_NAME = re.compile(r"(?:^|[-_.])(q5_k(?:_[sm])?|q5_[01]|q3_k(?:_[sml])?|q2_k(?:_s)?"
                              r"|iq[1-4]_[a-z]+|bf16|tq[12]_0|mxfp4)(?=[-_.]|$)", re.I)


def unreadable_name(filename: str) -> str:
    """Why a GGUF file of this name cannot be loaded here (its quantisation, by llama.cpp's
    naming, has tensors OpenVINO GenAI does not read), naming what to use; "" otherwise."""
    found = _UNREADABLE_NAME.search(filename.rsplit("/", 1)[-1].removesuffix(".gguf"))
    if found is None:
        return ""
    return (f"{filename} is quantised as {found.group(1).upper()}, whose tensors OpenVINO "
            f"GenAI's GGUF reader does not take: use a {READABLE_FILES} file of the model")


class UnreadableGGUF(ModelInfoError):
    """A GGUF file holding tensors of a type OpenVINO GenAI cannot read."""


def unreadable(header: GGUFHeader) -> str:
    """Why OpenVINO GenAI's GGUF reader cannot load a file with this header (tensors of a
    type it does not take), naming what to use instead; "" when it can."""
    other = sorted(t for t in header.elements_by_type if t not in READABLE_TENSOR_TYPES)
    if not other:
        return ""
    named = ", ".join(GGML_TENSOR_TYPES.get(t, f"type {t}") for t in other)
    return (f"the file holds {named} tensors, which OpenVINO GenAI's GGUF reader does not "
            f"take (it takes F32, F16, Q4_0, Q4_1, Q4_K, Q6_K and Q8_0): use a "
            f"{READABLE_FILES} file of the same model")


def unreadable_file(path: Path) -> str:
    """unreadable() for the GGUF file at `path`, checked before a load would fail deep in
    native code (or a switch unload a working model for it); "" also for a file this reader
    cannot follow, which is GenAI's to judge in the load."""
    try:
        return unreadable(read_gguf_header(path, max_array_len=0))
    except (ModelInfoError, OSError):
        return ""
