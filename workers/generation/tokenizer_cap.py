"""A model folder's tokenizer without the length cap some conversions bake into it.

OpenVINO GenAI's GGUF reader writes a tokenizer IR whose token ids pass through
`Minimum(ends - begins, 8192)`: whatever the model's context (32,768 for Qwen2.5-Coder) and
whatever `max_length` or `truncation` encode() is given, a longer text comes out as its last
8,192 tokens. The system prompt and the tool definitions were cut from agents' prompts
without a word (issue 42). Tokenizers converted by openvino_tokenizers from Transformers
files truncate only when encode() asks (a `Truncate` behind a runtime switch), so they have
no such node.

So that constant is replaced by the largest int32: every prompt is encoded whole, and the
worker's own limits (prompt_fit.py) refuse or trim it visibly. In the folders the model cache
converts GGUF files into (workers/gguf_ir.py) the tokenizer's files are rewritten so, once
(lift_in_place), and the pipeline loads them as they are; elsewhere (a folder this process
may not change) the worker builds the lifted tokenizer in memory beside the pipeline's
(whole_tokenizer), which gets token ids, never text.
"""

from __future__ import annotations

import logging
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

TOKENIZER = "openvino_tokenizer"
DETOKENIZER = "openvino_detokenizer"
NO_CAP = 2**31 - 1
_INT_TYPES: dict[str, np.dtype[Any]] = {"i32": np.dtype("<i4"), "i64": np.dtype("<i8")}


@dataclass(frozen=True)
class Cap:
    """One length cap: the scalar Const layer that feeds a Minimum over token counts."""

    const_id: str
    dtype: np.dtype[Any]
    value: int


def find_caps(xml: str, weights: bytes) -> list[Cap]:
    """The caps in a tokenizer IR: a Minimum whose inputs are a length (a Subtract of ends
    and begins) and a scalar integer Const."""
    root = ET.fromstring(xml)
    layers = {layer.get("id", ""): layer for layer in root.iter("layer")}
    feeds: dict[str, list[str]] = {}
    for edge in root.iter("edge"):
        feeds.setdefault(edge.get("to-layer", ""), []).append(edge.get("from-layer", ""))
    caps = []
    for lid, layer in layers.items():
        if layer.get("type") != "Minimum":
            continue
        sources = [layers[s] for s in feeds.get(lid, []) if s in layers]
        kinds = sorted(s.get("type", "") for s in sources)
        if kinds != ["Const", "Subtract"]:
            continue
        const = next(s for s in sources if s.get("type") == "Const")
        data = const.find("data")
        if data is None or data.get("shape") != "" or data.get("element_type") not in _INT_TYPES:
            continue
        dtype = _INT_TYPES[data.get("element_type", "")]
        offset = int(data.get("offset", "-1"))
        if not 0 <= offset <= len(weights) - dtype.itemsize:
            continue
        value = int(np.frombuffer(weights, dtype, 1, offset)[0])
        caps.append(Cap(const.get("id", ""), dtype, value))
    return caps


def live_caps(xml: str, weights: bytes) -> list[Cap]:
    """The caps that still cut: those below NO_CAP (a lifted tokenizer keeps the Minimum)."""
    return [cap for cap in find_caps(xml, weights) if cap.value < NO_CAP]


def uncapped(xml: str, weights: bytes, caps: list[Cap], value: int = NO_CAP) -> tuple[str, bytes]:
    """The IR with each cap's Const pointing at `value` (NO_CAP: no cap), appended to the
    weights (a Const's bytes may be shared with another Const, so they are never
    overwritten)."""
    root = ET.fromstring(xml)
    extra = bytearray(weights)
    for cap in caps:
        layer = next(x for x in root.iter("layer") if x.get("id") == cap.const_id)
        data = layer.find("data")
        assert data is not None  # NOTE: find_caps checked it
        while len(extra) % cap.dtype.itemsize:
            extra.append(0)
        data.set("offset", str(len(extra)))
        data.set("size", str(cap.dtype.itemsize))
        extra += np.array([value], cap.dtype).tobytes()
    return ET.tostring(root, encoding="unicode"), bytes(extra)


def _capped(folder: Path) -> tuple[str, bytes, list[Cap]] | None:
    """The folder's tokenizer IR (XML, weights) and its live caps, or None when it has no
    tokenizer IR or no cap that still cuts."""
    xml_path = folder / f"{TOKENIZER}.xml"
    if not xml_path.is_file():
        return None
    xml = xml_path.read_text(encoding="utf-8")
    weights = (folder / f"{TOKENIZER}.bin").read_bytes()
    caps = live_caps(xml, weights)
    return (xml, weights, caps) if caps else None


def _replace(path: Path, data: bytes) -> None:
    """`path` replaced by `data` at once: written beside, synced, renamed over it."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with partial.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def lift_in_place(folder: Path) -> bool:
    """The folder's tokenizer files rewritten without their caps; False if there were none.

    NOTE: the weights go first and only grow (uncapped() appends), so a process that reads the
    folder meanwhile, with the old or the new XML, finds every offset it names. A file shared
    by hard links elsewhere keeps its content there (a new file takes the name)."""
    capped = _capped(folder)
    if capped is None:
        return False
    xml, weights = uncapped(*capped)
    _replace(folder / f"{TOKENIZER}.bin", weights)
    _replace(folder / f"{TOKENIZER}.xml", xml.encode("utf-8"))
    caps = capped[2]
    log.info("the tokenizer's length cap of %s tokens is lifted in %s: prompts are encoded "
             "whole and held to the model's context", ", ".join(str(c.value) for c in caps),
             folder)
    return True


def whole_tokenizer(folder: str | Path) -> Any:
    """The folder's tokenizer with its length caps lifted (an openvino_genai.Tokenizer), or
    None when it has none (or the folder has no tokenizer IR: the pipeline's own serves)."""
    path = Path(folder)
    capped = _capped(path)
    if capped is None:
        return None
    import openvino as ov
    import openvino_genai as ov_genai

    caps = capped[2]
    xml, weights = uncapped(*capped)
    detok_xml = (path / f"{DETOKENIZER}.xml").read_text(encoding="utf-8")
    detok_bin = (path / f"{DETOKENIZER}.bin").read_bytes()
    tokenizer = ov_genai.Tokenizer(
        xml, ov.Tensor(np.frombuffer(weights, np.uint8).copy()),
        detok_xml, ov.Tensor(np.frombuffer(detok_bin, np.uint8).copy()))
    log.info("the tokenizer's length cap of %s tokens is lifted: prompts are encoded whole "
             "and held to the model's context", ", ".join(str(c.value) for c in caps))
    return tokenizer
