"""The embedded SmolLM2 GGUF, cut to its first layers, with a longer context in its header: a
model whose context is more than the 8,192 tokens OpenVINO GenAI's GGUF tokenizer caps at
(issue 42).

Qwen2.5-Coder-1.5B (32,768) is such a model, but a 12,000-token prefill of it takes minutes on
two cores; the whole SmolLM2's takes half a minute, the two layers of serverctl.small_gguf()'s
copy a few seconds. Only the header's `llama.context_length` differs from that copy (its text
is noise, and past SmolLM2's trained length anyway: the tests look at token counts, the
tokenizer's and the template's, which are the embedded model's).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from serverctl import small_gguf

KEY = b"llama.context_length"
UINT32 = 4


def with_context(cache: Path, context: int) -> Path:
    """`<cache>/<small_gguf()>-ctx<context>.gguf`, made once (written aside, then
    renamed)."""
    source = small_gguf()
    out = cache / f"{source.stem}-ctx{context}.gguf"
    if out.is_file():
        return out
    data = bytearray(source.read_bytes())
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
