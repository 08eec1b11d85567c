"""A model's chat template and tokenizer: prompts rendered and counted exactly.

The counts decide routing (a prompt too long for this worker goes to another) and what
/tokenize answers; `fewest_tokens` refuses a prompt far too long without tokenizing it.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import numpy as np
import openvino_genai as ov_genai

from npu_proxy.protocol.messages import Generate, Tokenize, joined_system
from npu_proxy.workers.generation.detok import (
    ByteDetokenizer,
    Detokenizer,
    TokenBytes,
    byte_pieces,
)
from npu_proxy.workers.generation.tokenizer_cap import whole_tokenizer

log = logging.getLogger(__name__)


# NOTE: the most characters one token may stand for when the vocabulary cannot be read; no
# tokenizer in use comes near it (SmolLM2's longest entry is 81 bytes).
FALLBACK_TOKEN_CHARS = 256


def longest_token(tokenizer: ov_genai.Tokenizer) -> int:
    """The most characters one token of this vocabulary stands for: its longest entry's length
    in bytes (a UTF-8 character takes at least one), or FALLBACK_TOKEN_CHARS."""
    try:
        vocab = tokenizer.get_vocab()
        return max(len(entry) for entry in vocab) or FALLBACK_TOKEN_CHARS
    except Exception as exc:  # NOTE: only makes the check on characters looser
        log.info("vocabulary not readable (%s); assuming a token is at most %d characters",
                 exc, FALLBACK_TOKEN_CHARS)
        return FALLBACK_TOKEN_CHARS


# The tokens llama.cpp ends every generation at besides the model's own end of sequence (its
# vocabulary's end-of-generation set): a turn's or a text's end, and fill-in-the-middle's pad
# and separators. Qwen2.5's GGUF names <|im_end|> its end of sequence; a raw completion or
# a fill-in-the-middle ends in <|endoftext|>, past which the model wrote on until max_tokens.
END_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
             "<|endoftext|>", "<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<|fim_pad|>",
             "<|repo_name|>", "<|file_sep|>", "<|return|>", "<|call|>")


def end_ids(tokenizer: ov_genai.Tokenizer) -> set[int]:
    """The ids of END_TEXTS in this vocabulary. Harmony's (gpt-oss) <|end|> closes a channel,
    not the answer: not an end where <|return|> is one, as llama.cpp has it."""
    try:
        vocab = {bytes(entry): int(i) for entry, i in tokenizer.get_vocab().items()}
    except Exception as exc:  # NOTE: only the model's own end of sequence then
        log.info("vocabulary not readable (%s): no end tokens besides the model's", exc)
        return set()
    ends = {text: vocab[text.encode()] for text in END_TEXTS if text.encode() in vocab}
    if "<|return|>" in ends:
        ends.pop("<|end|>", None)
    return set(ends.values())


class Prompting:
    """Chat template and tokenizer of one model: the exact token counts used for routing."""

    @classmethod
    def of_model(cls, folder: str, pipeline_tokenizer: ov_genai.Tokenizer,
                 context_length: int, chat_template: str = "") -> Prompting:
        """The model's prompting with its folder's tokenizer whole: without the length cap a
        GGUF conversion bakes in (tokenizer_cap.py), else the pipeline's own tokenizer."""
        whole = whole_tokenizer(folder)
        return cls(pipeline_tokenizer if whole is None else whole, context_length,
                   chat_template)

    def __init__(self, tokenizer: ov_genai.Tokenizer, context_length: int,
                 chat_template: str = "") -> None:
        self.tokenizer = tokenizer
        if chat_template:  # the configured one, in place of the model's own
            tokenizer.set_chat_template(chat_template)
        self.context_length = context_length
        self.token_chars = longest_token(tokenizer)
        self.ends = end_ids(tokenizer)
        # Each token's bytes, where joining them is exactly the tokenizer's decode.
        self.pieces = byte_pieces(tokenizer)
        self.token_bytes = TokenBytes(tokenizer, self.pieces)

    def detokenizer(self) -> ByteDetokenizer | Detokenizer:
        """A new request's incremental detokenizer."""
        if self.pieces is not None:
            return ByteDetokenizer(self.pieces)
        return Detokenizer(self.tokenizer)

    def render(self, msg: Generate | Tokenize) -> str:
        """The prompt: the chat through the template. Where the template refuses the chat
        and a system turn follows the first message (which Claude Code sends in every
        request: newer Qwen's "System message must be at the beginning", Gemma's and
        Mistral's role alternation), every system turn's text goes into one leading system
        message, in their order, as agent proxies do for models that predate
        mid-conversation system messages; a refusal of that too is the request's 400."""
        if msg.messages is None:
            return msg.prompt or ""
        history = [msgspec.to_builtins(m) for m in msg.messages]
        try:
            return self._apply(msg, history)
        except Exception:
            if not any(m["role"] == "system" for m in history[1:]):
                raise
        systems = [m["content"] for m in history if m["role"] == "system"]
        rest = [m for m in history if m["role"] != "system"]
        log.info("the chat template refuses a system turn after the first message: %d system "
                 "turns joined into one leading system message", len(systems),
                 extra={"request_id": msg.log_id})
        return self._apply(msg, [{"role": "system", "content": joined_system(systems)}, *rest])

    def _apply(self, msg: Generate | Tokenize, history: list[dict[str, Any]]) -> str:
        opening = msg.add_generation_prompt if isinstance(msg, Tokenize) else True
        return str(self.tokenizer.apply_chat_template(
            history, add_generation_prompt=opening, tools=msg.tools or None,
            extra_context=msg.template_vars or None))

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray[Any, Any]:
        # NOTE: the chat template already places the special tokens.
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).input_ids.data
        return np.asarray(ids, dtype=np.int64).reshape(1, -1)

    def specials(self) -> dict[str, str]:
        """The special tokens' texts the tokenizer names (eos_token, bos_token, pad_token)."""
        found: dict[str, str] = {}
        for name, get in (("eos_token", self.tokenizer.get_eos_token),
                          ("bos_token", self.tokenizer.get_bos_token),
                          ("pad_token", self.tokenizer.get_pad_token)):
            try:
                text = str(get())
            except Exception:  # NOTE: a tokenizer without it
                continue
            if text:
                found[name] = text
        return found

    def check_ids(self, tokens: list[int]) -> None:
        """A ValueError (the request's 400) naming the first id out of the vocabulary."""
        size = self.token_bytes.vocab_size
        bad = next((t for t in tokens if not 0 <= t < size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is not in the vocabulary (0 to {size - 1})")

    def decode(self, tokens: list[int]) -> str:
        """Token ids back to text, special tokens included; a 400 for an id out of range."""
        self.check_ids(tokens)
        return str(self.tokenizer.decode(tokens, skip_special_tokens=False)) if tokens else ""

    def fewest_tokens(self, text: str) -> int:
        """A lower bound of the text's token count, from its length alone: no token stands
        for more than `token_chars` characters.

        NOTE: tokenizing holds the GIL, so the worker's heartbeat thread waits for it: 4 MB of
        text took 3 s (one long word) to 6.5 s (CJK) here, for nothing when the prompt cannot
        fit anyway. A text with more than limit * token_chars characters is refused unread.
        (Characters alone bound the count from below only this way round: that every token
        stands for at least one character gives tokens <= characters, no refusal.)
        """
        return -(-len(text) // self.token_chars)
