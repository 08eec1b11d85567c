"""Describe a model on disk (a GGUF file or an OpenVINO IR folder) for Ollama's
/api/tags, /api/show and /api/ps.

Pure Python: the GGUF header is read by models/gguf.py and an IR folder is described from its
HF-style ``config.json``; the files' digests come from models/digests.py. No OpenVINO import.
"""

from __future__ import annotations

import html
import json
import logging
import os
import re
import threading
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from npu_proxy.models.digests import DigestCache, StatKey, stat_key
from npu_proxy.models.gguf import (
    GGML_TENSOR_TYPES,
    GGUF_FILE_TYPES,
    GGUFError,
    GGUFHeader,
    ModelInfoError,
    SkippedArray,
    read_gguf_header,
)

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

IR_XML = "openvino_model.xml"
# A vision-language model exported by optimum-intel has its language model here instead.
VLM_XML = "openvino_language_model.xml"

# Keys that are shown elsewhere (template) or are bulk data, never in model_info.
_MODEL_INFO_EXCLUDED = {"tokenizer.chat_template"}





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


def _ir_context(folder: Path, cfg: dict[str, object]) -> int:
    """The context length; a vision-language model's is its language model's (text_config);
    a sentence-transformers model's the length it embeds (sentence_bert_config.json's
    max_seq_length: 256 for all-MiniLM-L6-v2, whose position embeddings take 512), which is
    the length the embed worker serves and so the one it reports."""
    text = cfg.get("text_config")
    inner = text.get("max_position_embeddings") if isinstance(text, dict) else None
    positions = _int(cfg.get("max_position_embeddings") or inner)
    embeds = _int(_read_json(folder / "sentence_bert_config.json").get("max_seq_length"))
    return min(embeds, positions) if embeds and positions else embeds or positions


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
    context = _ir_context(folder, cfg)
    if context:  # NOTE: what is served, where it is less than the positions (_ir_context)
        model_info[f"{arch}.context_length"] = context
    stats = [f.stat() for f in files]
    return ModelDetails(
        format="openvino",
        family=arch,
        families=[arch],
        parameter_size=format_parameter_count(params) if params else "",
        quantization_level=_ir_quantization(folder),
        architecture=arch,
        context_length=context,
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
# Public entry point

_caches: dict[Path | None, DigestCache] = {}
_details: dict[tuple[StatKey, ...], ModelDetails] = {}
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


def describe_model(path: Path, cache_dir: Path | None = None) -> ModelDetails:
    """Describe a `.gguf` file or an OpenVINO IR folder. Nothing is written beside the model;
    digests are cached in memory and, if `cache_dir` is given, in a small JSON file there."""
    path = path.resolve()
    if path.is_dir():
        if not (path / IR_XML).is_file() and not (path / VLM_XML).is_file():
            raise ModelInfoError(f"{path}: no {IR_XML} (nor {VLM_XML})")
        files = _folder_files(path)
        stat_keys = tuple(stat_key(f) for f in files)
    elif path.is_file():
        files, stat_keys = [path], (stat_key(path),)
    else:
        raise ModelInfoError(f"{path}: no such file or folder")
    # NOTE: keyed by every file's StatKey: a changed model is described afresh.
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
        return _ir_context(path, _read_json(path / "config.json"))
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


def special_tokens(path: Path) -> set[str]:
    """The vocabulary's tokens shaped like special ones (`<...>`, at most 32 characters): from
    the GGUF's token list or the folder's added tokens; what `fim_form` looks for."""
    path = path.resolve()
    if path.is_file():
        tokens = read_gguf_header(path, max_array_len=1 << 20).metadata.get(
            "tokenizer.ggml.tokens")
        found: list[object] = tokens if isinstance(tokens, list) else []
    else:
        added = _read_json(path / "tokenizer_config.json").get("added_tokens_decoder")
        entries = list(added.values()) if isinstance(added, dict) else []
        listed = _read_json(path / "tokenizer.json").get("added_tokens")
        entries += listed if isinstance(listed, list) else []
        found = [e.get("content") for e in entries if isinstance(e, dict)]
    return {t for t in found if isinstance(t, str) and len(t) <= 32 and t[:1] == "<"
            and t[-1:] == ">"}
