"""Synthesized speech as the file a client asked for: wav, pcm, flac, mp3 or opus.

The worker sends mono int16 samples at the voice's rate, a sentence at a time. `Encoder`
turns them into the bytes of the response: wav and pcm piece by piece (a streamed wav's
header has the unknown sizes set to 0xFFFFFFFF, as streaming encoders write it), the
compressed formats (soundfile's libsndfile: FLAC, MP3, Ogg Opus) once all samples are in.

NOTE: OpenAI's `pcm` is 24 kHz signed 16-bit little-endian with no header, and clients
play it at that rate; it is resampled to 24 kHz (soxr), and so is opus, whose encoder takes
only 8/12/16/24/48 kHz. wav, flac and mp3 keep the voice's own rate.
"""

from __future__ import annotations

import io
import struct
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

# The formats served and their media types (OpenAI's); aac is not: libsndfile has no encoder.
MEDIA = {"mp3": "audio/mpeg", "opus": "audio/opus", "flac": "audio/flac",
         "wav": "audio/wav", "pcm": "audio/pcm"}
PCM_RATE = 24_000
_COMPRESSED = {"mp3": ("MP3", "MPEG_LAYER_III"), "flac": ("FLAC", "PCM_16"),
               "opus": ("OGG", "OPUS")}
_UNKNOWN = 0xFFFFFFFF


def wav_header(rate: int, frames: int | None) -> bytes:
    """A mono 16-bit PCM RIFF header; `frames` None = unknown (a streamed file)."""
    data = _UNKNOWN if frames is None else frames * 2
    riff = _UNKNOWN if frames is None else 36 + data
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data))


class Encoder:
    """One response's audio: feed() each chunk of int16 samples, then finish()."""

    def __init__(self, response_format: str, streamed: bool) -> None:
        if response_format not in MEDIA:
            raise ValueError(response_format)
        self.format = response_format
        self.streamed = streamed
        self._rate = 0
        self._kept: list[np.ndarray[Any, Any]] = []
        self._resampler: Any = None

    def feed(self, pcm: bytes, rate: int) -> bytes:
        """The bytes of the file that can be sent now."""
        import numpy as np  # NOTE: loaded by then: api/speech.py awaits numpy_ready (preload.py)

        samples = np.frombuffer(pcm, dtype="<i2")
        first, self._rate = not self._rate, rate
        if self.format == "pcm":
            return self._resample(samples, final=False).astype("<i2").tobytes()
        if self.format == "wav" and self.streamed:
            head = wav_header(rate, None) if first else b""
            return head + samples.tobytes()
        self._kept.append(samples)
        return b""

    def finish(self, rate: int) -> bytes:
        """The rest of the file, once the last chunk was fed (`rate` when none was)."""
        import numpy as np

        rate = self._rate or rate
        if self.format == "pcm":
            return (self._resample(np.zeros(0, dtype="<i2"), final=True).astype("<i2").tobytes()
                    if self._resampler is not None else b"")
        if self.format == "wav" and self.streamed:
            return b"" if self._rate else wav_header(rate, None)
        samples = np.concatenate(self._kept) if self._kept else np.zeros(0, dtype="<i2")
        if self.format == "wav":
            return wav_header(rate, samples.size) + samples.astype("<i2").tobytes()
        container, subtype = _COMPRESSED[self.format]
        if self.format == "opus":
            import soxr  # NOTE: imported on use, as _resample does: not at the gateway's start

            samples = soxr.resample(samples, rate, PCM_RATE) if samples.size else samples
            rate = PCM_RATE
        out = io.BytesIO()
        import soundfile  # NOTE: imported on use: not at the gateway's start

        soundfile.write(out, samples.astype(np.int16), rate, format=container, subtype=subtype)
        return out.getvalue()

    def _resample(self, samples: np.ndarray[Any, Any], final: bool) -> np.ndarray[Any, Any]:
        if self._resampler is None:
            import soxr

            self._resampler = soxr.ResampleStream(self._rate or PCM_RATE, PCM_RATE, 1,
                                                  dtype="int16")
        out: np.ndarray[Any, Any] = self._resampler.resample_chunk(samples, last=final)
        return out
