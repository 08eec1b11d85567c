"""The messages of speech: text from audio (Transcribe, answered with Delta frames when
streamed, then Transcription) and audio from text (Synthesize, answered with SpeechChunk
frames, then Speech). Part of the catalogue in messages.py, which holds them in its unions."""

from __future__ import annotations

from typing import Annotated

import msgspec

from npu_proxy.protocol.timings import Timings


class Transcribe(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Speech to text (answered with `Transcription`; with `stream`, `Delta` frames first)."""

    id: str
    model: str
    audio: bytes  # mono 16 kHz little-endian float32 samples (gateway/content/audio.py)
    deadline: float
    task: str = "transcribe"  # or "translate" (into English)
    language: str = ""  # ISO-639-1; "" = detected (multilingual models)
    prompt: str = ""  # Whisper's initial prompt: the text the speech continues
    temperature: float = 0.0
    timestamps: bool = False  # send the segments' times (Transcription.segments)
    stream: bool = False
    log_id: str = ""
    words: bool = False  # send each word's times (Transcription.words)


class Synthesize(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Text to speech (answered with `SpeechChunk` frames, one per sentence, then `Speech`)."""

    id: str
    model: str
    text: str
    deadline: float
    speed: float = 1.0  # 0.25-4.0; the voice's length_scale is divided by it
    log_id: str = ""


class Segment(msgspec.Struct, array_like=True):
    """A stretch of speech: seconds from the start of the audio, and its text."""

    start: float
    end: float
    text: str


class Word(msgspec.Struct, array_like=True):
    """A spoken word: seconds from the start of the audio, and its text."""

    word: str
    start: float
    end: float


# NOTE: Whisper decodes at most 448 tokens per 30 s window, and a word is at least one token:
# 600 s of audio (max_audio_seconds' default) holds at most 8960 words. The worker stops there.
MAX_WORDS = 10_000


class Transcription(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """The whole text of a Transcribe request (after its Delta frames, when streamed)."""

    id: str
    seq: int
    text: str
    duration: float  # seconds of audio
    timings: Timings
    language: str = ""
    segments: list[Segment] = []  # only when the request asked for timestamps
    tokens: int = 0  # generated
    # Only when the request asked for words; in order, at most MAX_WORDS.
    words: Annotated[list[Word], msgspec.Meta(max_length=MAX_WORDS)] = []


class SpeechChunk(msgspec.Struct, tag=True, array_like=True):
    """A stretch of synthesized speech: mono little-endian int16 samples at `sample_rate`."""

    id: str
    seq: int
    pcm: bytes
    sample_rate: int


class Speech(msgspec.Struct, tag=True, array_like=True):
    """The end of a Synthesize request's speech (after its SpeechChunk frames)."""

    id: str
    seq: int
    sample_rate: int
    samples: int  # in all chunks
    phonemes: int  # the model's input ids in all sentences (the request's "tokens")
    timings: Timings
