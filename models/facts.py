"""Describe a model on disk (a GGUF file or an OpenVINO IR folder) for Ollama's
/api/tags, /api/show and /api/ps.

Pure Python: the GGUF header is parsed here (format v2/v3, either byte order) and an IR
folder is described from its HF-style ``config.json``; no OpenVINO import is needed.
"""

from __future__ import annotations

import hashlib
import html
import json
import logging
import math
import mmap
import os
import re
import struct
import threading
from datetime import UTC, datetime
from pathlib import Path

import msgspec

logger = logging.getLogger(__name__)

__all__ = [
    "DigestCache",
    "GGUFError",
    "GGUFHeader",
    "ModelDetails",
    "ModelInfoError",
    "SkippedArray",
    "context_length",
    "describe_model",
    "format_parameter_count",
    "read_gguf_header",
]

GGUF_MAGIC = b"GGUF"
# NOTE: arrays longer than this (token lists, merges, scores) are not materialised; Ollama
# uses the same cut-off for /api/show without `verbose`.
DEFAULT_MAX_ARRAY_LEN = 1024
IR_XML = "openvino_model.xml"
# A vision-language model exported by optimum-intel has its language model here instead.
VLM_XML = "openvino_language_model.xml"

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
# Keys that are shown elsewhere (template) or are bulk data, never in model_info.
_MODEL_INFO_EXCLUDED = {"tokenizer.chat_template"}


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


class ModelDetails(msgspec.Struct, frozen=True, kw_only=True):
    """What Ollama's /api/tags, /api/show and /api/ps say about a model. Shared: do not mutate."""

    format: str  # "gguf" | "openvino"
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str
    architecture: str
    context_length: int
    embedding_length: int
    size: int
    digest: str  # "sha256:<hex>"
    modified_at: datetime
    chat_template: str
    model_info: dict[str, object]

    def ollama_details(self) -> dict[str, object]:
        """The `details` object of /api/tags, /api/show and /api/ps."""
        return {
            "parent_model": "",
            "format": self.format,
            "family": self.family,
            "families": list(self.families),
            "parameter_size": self.parameter_size,
            "quantization_level": self.quantization_level,
        }


# ---------------------------------------------------------------------------------------------
# GGUF


def _shortest_float32(value: float) -> float:
    """1e-05 rather than 9.999999747378752e-06: the shortest decimal that is the same float32."""
    packed = struct.pack("<f", value)
    for digits in range(6, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == packed:
            return candidate
    return value


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

    def value(self, vtype: int, max_array_len: int) -> object:
        if vtype in _SCALAR_CODES:
            return self.scalar(_SCALAR_CODES[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise GGUFError(f"unknown value type {vtype} at byte {self.pos}")
        item_type, length = self.u32(), self.u64()
        if length > max_array_len:
            self.skip_items(item_type, length)
            return SkippedArray(item_type, length)
        return [self.value(item_type, max_array_len) for _ in range(length)]

    def skip_items(self, item_type: int, length: int) -> None:
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
            for _ in range(length):
                self.skip_items(self.u32(), self.u64())
        else:
            raise GGUFError(f"unknown array item type {item_type} at byte {self.pos}")


def read_gguf_header(path: Path, *, max_array_len: int = DEFAULT_MAX_ARRAY_LEN) -> GGUFHeader:
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
            metadata: dict[str, object] = {}
            for _ in range(kv_count):
                key = r.string()
                metadata[key] = r.value(r.u32(), max_array_len)
            parameters = 0
            by_type: dict[int, int] = {}
            for _ in range(tensor_count):
                r.advance(r.u64())  # tensor name
                n_dims = r.u32()
                if n_dims > 8:
                    raise GGUFError(f"{path}: tensor with {n_dims} dimensions")
                dims = [r.u64() for _ in range(n_dims)]
                ggml_type = r.u32()
                r.advance(8)  # data offset
                elements = math.prod(dims)
                parameters += elements
                by_type[ggml_type] = by_type.get(ggml_type, 0) + elements
    return GGUFHeader(version, tensor_count, metadata, parameters, by_type)


def _gguf_quantization(header: GGUFHeader) -> str:
    file_type = header.metadata.get("general.file_type")
    if isinstance(file_type, int) and not isinstance(file_type, bool):
        return GGUF_FILE_TYPES.get(file_type, "unknown")
    if not header.elements_by_type:
        return "unknown"
    # NOTE: no file_type key (older converters): name the file after its dominant tensor type.
    dominant = max(header.elements_by_type.items(), key=lambda kv: kv[1])[0]
    return GGML_TENSOR_TYPES.get(dominant, "unknown")


def _int(value: object) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return 0


def _gguf_context(meta: dict[str, object]) -> int:
    arch = str(meta.get("general.architecture", "")) or "unknown"
    return _int(meta.get(f"{arch}.context_length"))


def _describe_gguf(path: Path, cache: DigestCache) -> ModelDetails:
    header = read_gguf_header(path)  # NOTE: first, so a non-GGUF file is not hashed for nothing
    meta = header.metadata
    arch = str(meta.get("general.architecture", "")) or "unknown"
    model_info: dict[str, object] = {
        k: v
        for k, v in meta.items()
        if k not in _MODEL_INFO_EXCLUDED and not isinstance(v, SkippedArray)
    }
    # NOTE: like Ollama, the count comes from the tensor table, not a converter's claim.
    model_info["general.parameter_count"] = header.parameter_count
    template = meta.get("tokenizer.chat_template")
    st = path.stat()
    return ModelDetails(
        format="gguf",
        family=arch,
        families=[arch],
        parameter_size=format_parameter_count(header.parameter_count),
        quantization_level=_gguf_quantization(header),
        architecture=arch,
        context_length=_gguf_context(meta),
        embedding_length=_int(meta.get(f"{arch}.embedding_length")),
        size=st.st_size,
        digest="sha256:" + cache.file_sha256(path),
        modified_at=datetime.fromtimestamp(st.st_mtime, UTC),
        chat_template=template if isinstance(template, str) else "",
        model_info=model_info,
    )


# ---------------------------------------------------------------------------------------------
# OpenVINO IR folder

# HF config key -> Ollama model_info suffix (after "<arch>.")
_HF_TO_OLLAMA: dict[str, str] = {
    "max_position_embeddings": "context_length",
    "hidden_size": "embedding_length",
    "num_hidden_layers": "block_count",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "vocab_size": "vocab_size",
    "sliding_window": "attention.sliding_window",
}
# Decoder families whose blocks are attention + gated (3-matrix) MLP: the estimate below holds.
_GATED_MLP_TYPES = {
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite",
    "olmo", "olmo2", "smollm3", "phi3", "cohere", "stablelm", "internlm2", "exaone",
}  # fmt: skip
_RT_INFO_TAIL = 256 * 1024


def _read_json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("unreadable json file", extra={"path": str(path), "error": str(exc)})
        return {}
    return data if isinstance(data, dict) else {}


def _read_tail(path: Path, n: int = _RT_INFO_TAIL) -> str:
    """rt_info sits at the end of an IR .xml; reading the tail avoids parsing megabytes."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - n))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _estimate_parameters(cfg: dict[str, object]) -> int:
    """Exact for llama-style decoders (tied or untied embeddings); 0 when unsure."""
    if str(cfg.get("model_type", "")) not in _GATED_MLP_TYPES:
        return 0
    if any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return 0
    vocab, hidden = _int(cfg.get("vocab_size")), _int(cfg.get("hidden_size"))
    layers, inter = _int(cfg.get("num_hidden_layers")), _int(cfg.get("intermediate_size"))
    heads = _int(cfg.get("num_attention_heads"))
    if not (vocab and hidden and layers and inter and heads):
        return 0
    kv_heads = _int(cfg.get("num_key_value_heads")) or heads
    head_dim = _int(cfg.get("head_dim")) or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings", True) else 2)
    return embeddings + layers * per_layer + hidden


def _ir_quantization(folder: Path) -> str:
    ov_cfg = _read_json(folder / "openvino_config.json")
    q = ov_cfg.get("quantization_config")
    if isinstance(q, dict) and q:
        dtype = q.get("dtype") or q.get("weight_format")
        bits = _int(q.get("bits"))
        name = str(dtype) if dtype else (f"int{bits}" if bits else "")
        if name:
            sym = q.get("sym")
            suffix = "" if sym is None else ("_sym" if sym else "_asym")
            group = _int(q.get("group_size"))
            return (name + suffix + (f"_g{group}" if group > 0 else "")).upper()
    if isinstance(ov_cfg.get("dtype"), str) and ov_cfg["dtype"] not in ("", "auto"):
        return str(ov_cfg["dtype"]).upper()
    # NOTE: NNCF records weight compression in the model's rt_info, e.g.
    # <weight_compression><mode value="int4_asym"/><group_size value="128"/>...
    tail = _read_tail(folder / (VLM_XML if (folder / VLM_XML).is_file() else IR_XML))
    block = re.search(r"<weight_compression>(.*?)</weight_compression>", tail, re.S)
    if block:
        mode = re.search(r'<mode value="([^"]+)"', block.group(1))
        size = re.search(r'<group_size value="(-?\d+)"', block.group(1))
        if mode:
            g = int(size.group(1)) if size else 0
            return (mode.group(1) + (f"_g{g}" if g > 0 else "")).upper()
    return "unknown"


def _ir_chat_template(folder: Path) -> str:
    tpl = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(tpl, str):
        return tpl
    if isinstance(tpl, list):  # named templates: [{"name": "default", "template": ...}]
        named = {str(t.get("name")): t.get("template") for t in tpl if isinstance(t, dict)}
        chosen = named.get("default", next(iter(named.values()), None))
        if isinstance(chosen, str):
            return chosen
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    m = re.search(r'<chat_template value="([^"]*)"', _read_tail(folder / "openvino_tokenizer.xml"))
    return html.unescape(m.group(1)) if m else ""


def _ir_context(cfg: dict[str, object]) -> int:
    """The context length; a vision-language model's is its language model's (text_config)."""
    text = cfg.get("text_config")
    inner = text.get("max_position_embeddings") if isinstance(text, dict) else None
    return _int(cfg.get("max_position_embeddings") or inner)


def _describe_ir(folder: Path, files: list[Path], cache: DigestCache) -> ModelDetails:
    cfg = _read_json(folder / "config.json")
    arch = str(cfg.get("model_type", "")) or "unknown"
    params = _estimate_parameters(cfg)
    model_info: dict[str, object] = {"general.architecture": arch}
    if params:
        model_info["general.parameter_count"] = params
    for hf_key, suffix in _HF_TO_OLLAMA.items():
        value = cfg.get(hf_key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            model_info[f"{arch}.{suffix}"] = value
    stats = [f.stat() for f in files]
    return ModelDetails(
        format="openvino",
        family=arch,
        families=[arch],
        parameter_size=format_parameter_count(params) if params else "",
        quantization_level=_ir_quantization(folder),
        architecture=arch,
        context_length=_ir_context(cfg),
        embedding_length=_int(cfg.get("hidden_size")),
        size=sum(s.st_size for s in stats),
        digest="sha256:" + cache.folder_sha256(folder, files),
        modified_at=datetime.fromtimestamp(
            max((s.st_mtime for s in stats), default=0), UTC
        ),
        chat_template=_ir_chat_template(folder),
        model_info=model_info,
    )


# ---------------------------------------------------------------------------------------------
# Digests


class _CacheEntry(msgspec.Struct):
    size: int
    mtime_ns: int
    sha256: str


class _CacheFile(msgspec.Struct):
    version: int = 1
    entries: dict[str, _CacheEntry] = msgspec.field(default_factory=dict)


_StatKey = tuple[str, int, int]
_HASH_CHUNK = 4 * 1024 * 1024


def _hash_file(path: Path) -> str:
    # NOTE: not hashlib.file_digest, which needs Python 3.11 (the project supports 3.10).
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class DigestCache:
    """sha256 of files keyed by (absolute path, size, mtime_ns), in memory and, when given a
    `cache_dir`, in `<cache_dir>/digests.json` so a restart does not re-hash. Thread-safe."""

    FILE_NAME = "digests.json"

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_file = cache_dir / self.FILE_NAME if cache_dir is not None else None
        self._memory: dict[_StatKey, str] = {}
        self._lock = threading.Lock()

    def file_sha256(self, path: Path) -> str:
        """Hex sha256 of `path`'s content, hashed at most once per (path, size, mtime)."""
        path = path.resolve()
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        with self._lock:
            if (hit := self._memory.get(key)) is not None:
                return hit
            if (hit := self._from_disk(key)) is not None:
                self._memory[key] = hit
                return hit
        hex_digest = _hash_file(path)
        logger.debug("hashed model file", extra={"path": key[0], "size": key[1]})
        with self._lock:
            self._memory[key] = hex_digest
            self._to_disk(key, hex_digest)
        return hex_digest

    def _load(self) -> _CacheFile:
        if self.cache_file is None:
            return _CacheFile()
        try:
            return msgspec.json.decode(self.cache_file.read_bytes(), type=_CacheFile)
        except FileNotFoundError:
            return _CacheFile()
        except (OSError, msgspec.DecodeError) as exc:
            logger.warning(
                "ignoring digest cache", extra={"path": str(self.cache_file), "error": str(exc)}
            )
            return _CacheFile()

    def _from_disk(self, key: _StatKey) -> str | None:
        entry = self._load().entries.get(key[0])
        if entry is not None and (entry.size, entry.mtime_ns) == key[1:]:
            return entry.sha256
        return None

    def _to_disk(self, key: _StatKey, hex_digest: str) -> None:
        if self.cache_file is None:
            return
        # NOTE: re-read before writing so entries added by another process are kept.
        data = self._load()
        data.entries[key[0]] = _CacheEntry(key[1], key[2], hex_digest)
        tmp = self.cache_file.with_name(
            f"{self.FILE_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
        )
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(msgspec.json.encode(data))
            os.replace(tmp, self.cache_file)
        except OSError as exc:
            logger.warning(
                "cannot write digest cache", extra={"path": str(self.cache_file), "error": str(exc)}
            )
            tmp.unlink(missing_ok=True)

    def folder_sha256(self, folder: Path, files: list[Path]) -> str:
        """Hex sha256 of a manifest: one `<relative path>\\t<size>\\t<sha256>` line per file."""
        lines = [
            f"{f.relative_to(folder).as_posix()}\t{f.stat().st_size}\t{self.file_sha256(f)}\n"
            for f in files
        ]
        return hashlib.sha256("".join(lines).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Public entry point

_caches: dict[Path | None, DigestCache] = {}
_details: dict[tuple[_StatKey, ...], ModelDetails] = {}
_registry_lock = threading.Lock()


def _cache_for(cache_dir: Path | None) -> DigestCache:
    key = cache_dir.resolve() if cache_dir is not None else None
    with _registry_lock:
        if (cache := _caches.get(key)) is None:
            cache = _caches[key] = DigestCache(key)
        return cache


def _folder_files(folder: Path) -> list[Path]:
    # NOTE: hidden entries (.cache/, .gitattributes) are download bookkeeping, not the model.
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def _stat_key(path: Path) -> _StatKey:
    st = path.stat()
    return (str(path), st.st_size, st.st_mtime_ns)


def describe_model(path: Path, cache_dir: Path | None = None) -> ModelDetails:
    """Describe a `.gguf` file or an OpenVINO IR folder. Nothing is written beside the model;
    digests are cached in memory and, if `cache_dir` is given, in a small JSON file there."""
    path = path.resolve()
    if path.is_dir():
        if not (path / IR_XML).is_file() and not (path / VLM_XML).is_file():
            raise ModelInfoError(f"{path}: no {IR_XML} (nor {VLM_XML})")
        files = _folder_files(path)
        stat_keys = tuple(_stat_key(f) for f in files)
    elif path.is_file():
        files, stat_keys = [path], (_stat_key(path),)
    else:
        raise ModelInfoError(f"{path}: no such file or folder")
    # NOTE: keyed by every file's (path, size, mtime_ns): a changed model is described afresh.
    if (hit := _details.get(stat_keys)) is not None:
        return hit
    cache = _cache_for(cache_dir)
    details = _describe_ir(path, files, cache) if path.is_dir() else _describe_gguf(path, cache)
    _details[stat_keys] = details
    return details


def context_length(path: Path) -> int:
    """The model's context length in tokens, as `describe_model` reports it (0 when the files
    do not say), from the GGUF header or the IR folder's config.json alone: nothing is hashed."""
    path = path.resolve()
    if path.is_dir():
        return _ir_context(_read_json(path / "config.json"))
    if path.is_file():
        return _gguf_context(read_gguf_header(path).metadata)
    raise ModelInfoError(f"{path}: no such file or folder")


def chat_template(path: Path) -> str:
    """The model's chat template, as `describe_model` reports it ("" when the files have
    none), from the GGUF header or the IR folder's files alone: nothing is hashed."""
    path = path.resolve()
    if path.is_dir():
        return _ir_chat_template(path)
    if path.is_file():
        template = read_gguf_header(path).metadata.get("tokenizer.chat_template")
        return template if isinstance(template, str) else ""
    raise ModelInfoError(f"{path}: no such file or folder")


def format_parameter_count(n: int) -> str:
    """Ollama-style size label: 134_515_008 -> "135M", 1_100_048_384 -> "1.1B", 7e9 -> "7B"."""
    if n >= 999_500_000:
        return f"{n / 1e9:.1f}".removesuffix(".0") + "B"
    if n >= 999_500:
        return f"{round(n / 1e6)}M"
    if n >= 1000:
        return f"{round(n / 1e3)}K"
    return str(n)
