"""A model's own sampling defaults, from its files: what the OpenAI, Responses and Anthropic
APIs sample with where a request leaves a field out (gateway/api/request_path.py: after the
request, a created model's parameters and an embedded model's own defaults).

- A folder (a Transformers or OpenVINO IR model) with `generation_config.json`: its
  `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty`, as vLLM and OpenVINO
  Model Server take them (Qwen2.5-Coder's: temperature 0.7, top_p 0.8, top_k 20,
  repetition_penalty 1.05).
- A GGUF file: llama.cpp's own sampler defaults (temperature 0.8, top_k 40, top_p 0.95,
  min_p 0.05), what `llama-server` samples the same file with.

Without them a request that names no temperature (Claude Code sends none) sampled at
temperature 1 from the whole vocabulary: a small model's tail tokens were drawn, and its tool
calls came out with made-up arguments (Qwen2.5-Coder-1.5B under Claude Code overwrote the file
it was asked to read).

NOTE: the file is model data, so read as hostile: only numbers in each field's range are
taken, anything else is left out (the field stays unset).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

LLAMA_CPP_DEFAULTS: dict[str, float] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95,
                                        "min_p": 0.05}
# Each field taken from generation_config.json, with the range a value must lie in.
_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "top_k": (0.0, 1e6), "min_p": (0.0, 1.0),
    "repetition_penalty": (0.01, 10.0)}
MAX_CONFIG_BYTES = 1 << 20


def file_sampling(path: Path) -> dict[str, float]:
    """The sampling defaults of the model at `path` (a GGUF file or a model folder): {} when
    its files set none."""
    path = path.resolve()
    if path.is_file():
        return dict(LLAMA_CPP_DEFAULTS)
    config = path / "generation_config.json"
    try:
        if config.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"larger than {MAX_CONFIG_BYTES} bytes")
        data = json.loads(config.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("generation_config.json not read: %s", exc, extra={"path": str(config)})
        return {}
    found: dict[str, float] = {}
    for field, (low, high) in _RANGES.items():
        value = data.get(field) if isinstance(data, dict) else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if low <= value <= high:
            found[field] = int(value) if field == "top_k" else float(value)
    return found
