"""Text to a Piper voice's phoneme ids, sentence by sentence, with espeak-ng's library.

Piper (rhasspy/piper, piper-phonemize) phonemizes with espeak-ng clause by clause, keeps
each clause's punctuation as a phoneme (`.`, `?`, `!` end a sentence; `,`, `:`, `;` are
followed by a space), splits the IPA into Unicode code points after NFD decomposition, and
maps them with the voice's `phoneme_id_map`: BOS `^`, then each phoneme followed by the pad
`_`, then EOS `$`. Code points missing from the map are left out (as Piper does).

NOTE: Debian's libespeak-ng has no `espeak_TextToPhonemesWithTerminator` (Piper's patched
fork adds it); a clause's terminator is read from the text the call consumed instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import threading
import unicodedata
from collections.abc import Mapping, Sequence

BOS, EOS, PAD = "^", "$", "_"
SENTENCE_END = frozenset(".?!")
PAUSES = frozenset(",:;")
# NOTE: espeak_TextToPhonemes reads one character past a clause; a clause's punctuation is
# the last one before closing quotes/brackets and that read-ahead.
_TERMINATOR = re.compile(r"([.?!,:;])[\s\"'\u201d\u2019)\]}\u00bb]*\w?$")
# espeak marks a switch of language as "(fr)" ... "(en)"; Piper drops the marks.
_LANGUAGE_FLAG = re.compile(r"\([a-z\-]+\)")
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_DONT_EXIT = 0x8000
_CHARS_UTF8 = 1
_PHONEMES_IPA = 0x02


class PhonemizerError(RuntimeError):
    """espeak-ng is missing or refused the voice."""


class Phonemizer:
    """espeak-ng's library, for one voice. Its state is global: calls are serialised."""

    _lock = threading.Lock()

    def __init__(self, voice: str) -> None:
        name = ctypes.util.find_library("espeak-ng") or "libespeak-ng.so.1"
        try:
            lib = ctypes.cdll.LoadLibrary(name)
        except OSError as exc:
            raise PhonemizerError("libespeak-ng is not installed (Debian package espeak-ng)"
                                  ) from exc
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p,
                                          ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                              ctypes.c_int]
        lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        with self._lock:
            if lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, None,
                                     _INITIALIZE_DONT_EXIT) < 0:
                raise PhonemizerError("espeak-ng could not start (its data folder?)")
            if lib.espeak_SetVoiceByName(voice.encode()) != 0:
                raise PhonemizerError(f"espeak-ng has no voice {voice!r}")
        self._lib = lib
        self.voice = voice

    def sentences(self, text: str) -> list[list[str]]:
        """The phonemes of `text`, one list per sentence (code points, punctuation kept)."""
        data = text.encode()
        buffer = ctypes.create_string_buffer(data)
        start = ctypes.addressof(buffer)
        pointer = ctypes.c_void_p(start)
        sentences: list[list[str]] = []
        current: list[str] = []
        with self._lock:
            while pointer.value:
                before = pointer.value - start
                raw = self._lib.espeak_TextToPhonemes(ctypes.byref(pointer), _CHARS_UTF8,
                                                      _PHONEMES_IPA)
                after = pointer.value - start if pointer.value else len(data)
                clause = _LANGUAGE_FLAG.sub("", (raw or b"").decode("utf-8", "replace"))
                current.extend(unicodedata.normalize("NFD", clause.strip()))
                consumed = data[before:after].decode("utf-8", "ignore")
                found = _TERMINATOR.search(consumed)
                mark = found.group(1) if found else ""
                if mark:
                    current.append(mark)
                if mark in SENTENCE_END and mark:
                    if current:
                        sentences.append(current)
                    current = []
                elif mark in PAUSES or (current and current[-1] != " "):
                    current.append(" ")
        while current and current[-1] == " ":
            current.pop()
        if current:
            sentences.append(current)
        return [s for s in sentences if any(p.strip() and p not in PAUSES | SENTENCE_END
                                            for p in s)]


def phoneme_ids(phonemes: Sequence[str], id_map: Mapping[str, Sequence[int]]) -> list[int]:
    """A sentence's phonemes as the voice's input ids (Piper's rule: BOS, phoneme + pad, EOS)."""
    ids = list(id_map[BOS])
    for phoneme in phonemes:
        mapped = id_map.get(phoneme)
        if mapped is None:
            continue
        ids.extend(mapped)
        ids.extend(id_map[PAD])
    ids.extend(id_map[EOS])
    return ids
