"""Incremental detokenization: text for each new token as soon as it is complete.

Where the model's tokenizer decodes as its tokens' bytes joined (byte-level BPE: SmolLM2,
Llama 3, Qwen...), `ByteDetokenizer` joins them from a table built once per model, checked
against the tokenizer at load (`byte_pieces`): no OpenVINO call per token. (The detokenizer
model's call, 46 us alone, cost ~0.4 ms per token inside a worker whose inference threads
are busy: 4.5 % of a decode step, measured with py-spy --gil.) Other tokenizers get
`Detokenizer`, below.

OpenVINO GenAI's TextStreamer holds a few tokens back before it releases text, which costs
the first token ~50 ms on this CPU (measured). This decodes a short window instead, once per
push: what the window's text adds to what it has already released is new text, unless it
ends in an incomplete UTF-8 sequence (U+FFFD), which waits for the next token. (Decoding the
window with and without the newest tokens, twice per token, was two thirds of the worker's
Python time per decode step: about 0.45 ms of a 10 ms step, measured with py-spy.)

For logprobs, tokens are pushed one at a time, so each token's piece of the text is known:
a character split across tokens is the piece of the token that completes it. `TokenBytes`
gives a token's exact bytes from the vocabulary.
"""

from __future__ import annotations

import codecs
import logging
import random
from typing import Any

log = logging.getLogger(__name__)

_INCOMPLETE = "\ufffd"
# Random token sequences decoded both ways at load before the byte table is trusted...
_PROBES = 256
_PROBE_MAX_TOKENS = 24
# ...and texts, tokenized: spaces around punctuation (a decoder's clean-up of tokenization
# spaces), leading and doubled spaces (SentencePiece's), accents, scripts, emoji, code.
_PROBE_TEXTS = [
    "Hello , world . It 's a test ! Is it ? Yes : no ; maybe n't", "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n  doubled  spaces", "Ünïcödé 東京タワー 🙂🚀 ÀÉÎÕÜ ß ﬁ Ⅻ ½ ² ㎏",
    "مرحبا بالعالم Привет мир x\u200by \u0301combining", "def f(a, b):\n    return {'k': [a, b]}",
    "don't stop-believing... (yes) [no] {maybe} <tag/> a+b=c", " ", "",
]


def byte_pieces(tokenizer: Any) -> list[bytes] | None:
    """Each token id's bytes in the decoded text (b"" for special tokens), if joining them and
    decoding as UTF-8 (invalid bytes dropped) gives exactly what the tokenizer's own decode
    (special tokens skipped) gives, on random token sequences; else None."""
    try:
        vocab = tokenizer.get_vocab()
        size = max(vocab.values(), default=-1) + 1
        if size <= 0:
            return None
        pieces = [b""] * size
        for entry, token in vocab.items():
            pieces[int(token)] = bytes(entry)
        # NOTE: a special token decodes to nothing when skipped, though its entry (its name)
        # is text; a token that is part of a character decodes to nothing alone as well, but
        # its entry is no valid text on its own either.
        alone = tokenizer.decode([[t] for t in range(size)], skip_special_tokens=True)
        for token, text in enumerate(alone):
            if not text and pieces[token].decode("utf-8", "ignore"):
                pieces[token] = b""
        rng = random.Random(size)
        probes = [[rng.randrange(size) for _ in range(rng.randint(1, _PROBE_MAX_TOKENS))]
                  for _ in range(_PROBES)]
        # NOTE: and sequences of the most common kind: pieces of text around characters
        # split across tokens and special tokens.
        split = [t for t in range(size) if pieces[t] and not pieces[t].decode("utf-8", "ignore")]
        special = [t for t in range(size) if not pieces[t]]
        for _ in range(_PROBES):
            probe = [rng.randrange(size) for _ in range(rng.randint(1, 8))]
            for pool in (split, special):
                if pool:
                    probe.insert(rng.randrange(len(probe) + 1), rng.choice(pool))
            probes.append(probe)
        for text in _PROBE_TEXTS:
            probes.append([int(t) for t in tokenizer.encode(
                text, add_special_tokens=False).input_ids.data[0]] or [0])
        expected = tokenizer.decode(probes, skip_special_tokens=True)
        for probe, text in zip(probes, expected, strict=True):
            if b"".join(pieces[t] for t in probe).decode("utf-8", "ignore") != text:
                log.info("tokens decode differently from their joined bytes (%r); decoding "
                         "with the tokenizer", probe[:8])
                return None
        return pieces
    except Exception as exc:  # NOTE: only ever a slower path
        log.info("no byte table for this tokenizer (%s); decoding with the tokenizer", exc)
        return None


class ByteDetokenizer:
    """Text for new tokens by joining their bytes (`byte_pieces`): an incomplete character
    waits for the tokens that complete it; invalid bytes are dropped, as the tokenizer
    drops them. Same interface as Detokenizer."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.ids: list[int] = []
        self.read = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("ignore")

    @property
    def released(self) -> int:
        """How many of the tokens pushed have had their text released."""
        return self.read

    def prime(self, ids: list[int]) -> None:
        """Tokens whose text was released elsewhere (a resumed generation's start)."""
        self.push(ids)
        self.read = len(self.ids)

    def push(self, new_ids: list[int]) -> str:
        """New text for these tokens ("" while a character is incomplete)."""
        self.ids.extend(new_ids)
        pieces, size = self.pieces, len(self.pieces)
        text = self._utf8.decode(b"".join(pieces[t] if 0 <= t < size else b""
                                          for t in new_ids))
        if not self._utf8.getstate()[0]:
            self.read = len(self.ids)
        return text

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character is dropped, as the
        tokenizer drops it)."""
        rest = self._utf8.decode(b"", final=True)
        self.read = len(self.ids)
        return rest


class Detokenizer:
    """The text of a window of tokens, decoded once per push: what it adds to the window's
    text already released is new. The window starts where the previous one's last release
    began (so a tokenizer that drops a leading space, or merges pieces, sees the context it
    needs) and slides every WINDOW tokens, which costs one more decode then."""

    WINDOW = 8

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the decoding window
        self.read = 0  # tokens whose text has been released
        self.last = 0  # where the last release began
        self.shown = ""  # the text of ids[prefix:read]

    def _text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True)) if ids else ""

    @property
    def released(self) -> int:
        """How many of the tokens pushed have had their text released."""
        return self.read

    def prime(self, ids: list[int]) -> None:
        """Tokens whose text was released elsewhere (a resumed generation's start): the
        window's context for the next ones."""
        self.ids.extend(ids)
        self.read = self.last = len(self.ids)
        self.prefix = max(0, self.read - self.WINDOW)
        self.shown = self._text(self.ids[self.prefix:self.read])

    def push(self, new_ids: list[int]) -> str:
        """New text for these tokens ("" while a character is incomplete)."""
        self.ids.extend(new_ids)
        after = self._text(self.ids[self.prefix:])
        if after.endswith(_INCOMPLETE) or len(after) <= len(self.shown):
            return ""
        new = after[len(self.shown):]
        self.last, self.read, self.shown = self.read, len(self.ids), after
        if self.read - self.prefix > self.WINDOW:
            self.prefix = self.last
            self.shown = self._text(self.ids[self.prefix:self.read])
        return new

    def flush(self) -> str:
        """Whatever is left at the end, even an incomplete character."""
        after = self._text(self.ids[self.prefix:])
        rest = after[len(self.shown):] if len(after) > len(self.shown) else ""
        self.prefix = self.last = self.read = len(self.ids)
        self.shown = ""
        return rest


class TokenBytes:
    """A token's exact bytes, as it stands in the text: its vocabulary entry, or nothing for
    a special token (end of turn...), which decoding leaves out of the text."""

    def __init__(self, tokenizer: Any, pieces: list[bytes] | None = None) -> None:
        self.tokenizer = tokenizer
        # NOTE: the verified byte table (byte_pieces), when the model has one, answers
        # __call__ without decoding each new token twice.
        self.pieces = pieces
        self._vocab: dict[int, bytes] | None = None
        self._special: dict[int, bool] = {}
        self._size: int | None = None if pieces is None else len(pieces)

    def _entries(self) -> dict[int, bytes]:
        if self._vocab is None:
            # NOTE: read on the first request that asks, not at load: 49k entries for SmolLM2.
            self._vocab = {int(i): bytes(b) for b, i in self.tokenizer.get_vocab().items()}
        return self._vocab

    @property
    def vocab_size(self) -> int:
        """One more than the largest token id."""
        if self._size is None:
            self._size = max(self._entries(), default=-1) + 1
        return self._size

    def entry(self, token: int) -> bytes:
        """The token's vocabulary entry, a special token's name included."""
        return self._entries().get(token, b"")

    def __call__(self, token: int) -> bytes:
        if self.pieces is not None:
            return self.pieces[token] if 0 <= token < len(self.pieces) else b""
        special = self._special.get(token)
        if special is None:
            # NOTE: a piece of a split character decodes to "" either way; a special token
            # only when skipped.
            shown = self.tokenizer.decode([token], skip_special_tokens=False)
            kept = self.tokenizer.decode([token], skip_special_tokens=True)
            special = self._special[token] = bool(shown) and not kept
        return b"" if special else self._entries().get(token, b"")
