"""Uploaded audio files decoded to what Whisper reads: mono float32 samples at 16 kHz.

WAV (PCM, 8/16/24/32-bit) is read with the standard library's `wave`; every other format
libsndfile reads (FLAC, MP3, OGG Vorbis/Opus, float WAV, AIFF, ...) with `soundfile`, whose
wheels carry libsndfile. Several channels are averaged; another rate is resampled with
`soxr`. M4A/MP4 (AAC; Safari's MediaRecorder) and WebM/Matroska (Opus; Chrome's and
Firefox's) are read with PyAV (`av`, whose wheels carry FFmpeg) when the optional `audio`
extra is installed, else they are a 400 that says so. NOTE: PyAV is not a base dependency:
its wheel is 36 MB against libsndfile's 1-2 MB and links GPL-2.0 encoders (x264, x265) into
its FFmpeg, which a bundle of this Apache-2.0 server (.deb, PyInstaller) should not carry
unasked; and it does not replace soundfile, which the speech route's encoders also use.

Limits, checked from the header before the samples are decoded: the file's bytes
(`max_audio_bytes`, 413) and its length (`max_audio_seconds`, 400). Anything unreadable is a
400 naming the field `file`. Decoding is CPU work: callers run `decode` in a thread.
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from npu_proxy.gateway.core.errors import GatewayError, invalid

if TYPE_CHECKING:
    import numpy as np

SAMPLE_RATE = 16_000
FORMATS = "WAV, FLAC, MP3, OGG (Vorbis, Opus), AIFF, M4A/MP4 (AAC), WebM (Opus)"
AUDIO_EXTRA = "pip install 'npu-proxy[audio]'"


def _is_container(data: bytes) -> bool:
    """An MP4-family file (`ftyp` box: m4a, mp4, 3gp) or EBML (WebM, Matroska): FFmpeg's."""
    return data[4:8] == b"ftyp" or data[:4] == b"\x1a\x45\xdf\xa3"


@dataclass(frozen=True)
class AudioLimits:
    max_bytes: int
    max_seconds: float


@dataclass(frozen=True)
class Audio:
    samples: np.ndarray[Any, np.dtype[np.float32]]  # mono, SAMPLE_RATE

    @property
    def seconds(self) -> float:
        return len(self.samples) / SAMPLE_RATE

    def pcm(self) -> bytes:
        """Little-endian float32 bytes (protocol/messages.py Transcribe.audio)."""
        return self.samples.astype("<f4").tobytes()


def unreadable(detail: str) -> GatewayError:
    return invalid(f"'file' is not audio this server can read ({detail}); send one of: "
                   f"{FORMATS}", param="file")


def too_large(size: int, limits: AudioLimits) -> GatewayError:
    return GatewayError(413, "request_too_large",
                        f"'file' is {size} bytes; the limit is {limits.max_bytes} "
                        "(max_audio_bytes)", param="file")


def _too_long(seconds: float, limits: AudioLimits) -> GatewayError:
    return invalid(f"'file' is {seconds:.1f} s of audio; the limit is {limits.max_seconds:g} s "
                   "(max_audio_seconds)", param="file")


def _pcm_wav(data: bytes, limits: AudioLimits) -> tuple[np.ndarray[Any, Any], int] | None:
    """Integer PCM WAV through `wave`; None for a WAV that `wave` does not read (float)."""
    import numpy as np  # NOTE: in a worker thread (api/audio.py), preload.py

    try:
        with wave.open(io.BytesIO(data)) as wav:
            channels, width, rate = wav.getnchannels(), wav.getsampwidth(), wav.getframerate()
            frames = wav.getnframes()
            if rate <= 0 or channels <= 0:
                raise unreadable("a WAV header without a rate or channels")
            if frames / rate > limits.max_seconds:
                raise _too_long(frames / rate, limits)
            raw = wav.readframes(frames)
    except (wave.Error, EOFError) as exc:
        if "unknown format" in str(exc):
            return None  # NOTE: float or compressed WAV: libsndfile reads those.
        raise unreadable(f"a broken WAV file: {exc}") from None
    if width == 3:
        b = np.frombuffer(raw[:len(raw) // 3 * 3], np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8
        samples = ints.astype(np.float32) / float(1 << 23)
    elif width in (1, 2, 4):
        kind: Any = {1: np.dtype(np.uint8), 2: np.dtype("<i2"), 4: np.dtype("<i4")}[width]
        ints = np.frombuffer(raw[:len(raw) // width * width], kind)
        if width == 1:
            samples = (ints.astype(np.float32) - 128.0) / 128.0
        else:
            samples = ints.astype(np.float32) / float(1 << (8 * width - 1))
    else:
        raise unreadable(f"{8 * width}-bit WAV samples")
    usable = len(samples) // channels * channels
    return samples[:usable].reshape(-1, channels), rate


def _soundfile(data: bytes, limits: AudioLimits) -> tuple[np.ndarray[Any, Any], int]:
    try:
        import soundfile
    except ImportError:  # NOTE: a dependency; without it only PCM WAV is read
        raise unreadable("only PCM WAV is read without the soundfile package") from None
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as sound:
            if sound.samplerate <= 0 or sound.channels <= 0:
                raise unreadable("no sample rate or channels")
            if sound.frames > 0 and sound.frames / sound.samplerate > limits.max_seconds:
                raise _too_long(sound.frames / sound.samplerate, limits)
            # NOTE: read with a bound, since some formats (MP3) may not know their length.
            most = int(limits.max_seconds * sound.samplerate) + 1
            samples = sound.read(frames=most, dtype="float32", always_2d=True)
            rate = int(sound.samplerate)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        # NOTE: libsndfile's message names the in-memory file object; only its reason helps.
        raise unreadable(str(exc).rsplit(": ", 1)[-1] or type(exc).__name__) from None
    if len(samples) / rate > limits.max_seconds:
        raise _too_long(len(samples) / rate, limits)
    return samples, rate


def _container(data: bytes, limits: AudioLimits) -> tuple[np.ndarray[Any, Any], int]:
    """The first audio stream of an MP4 or WebM file, mixed to mono 16 kHz by FFmpeg."""
    import numpy as np  # NOTE: in a worker thread (api/audio.py), preload.py

    try:
        import av
    except ImportError:
        raise unreadable(f"M4A/MP4 and WebM are read with the optional `audio` extra: "
                         f"{AUDIO_EXTRA}") from None
    most = int(limits.max_seconds * SAMPLE_RATE) + 1
    pieces: list[np.ndarray[Any, Any]] = []
    count = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise unreadable("a container without an audio stream")
            stream = container.streams.audio[0]
            if container.duration is not None and \
                    container.duration / av.time_base > limits.max_seconds:
                raise _too_long(container.duration / av.time_base, limits)
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    piece = out.to_ndarray().reshape(-1)
                    pieces.append(piece)
                    count += piece.size
                # NOTE: the header's duration may be absent (a streamed WebM): a bound here.
                if count > most:
                    raise _too_long(count / SAMPLE_RATE, limits)
            for out in resampler.resample(None):
                pieces.append(out.to_ndarray().reshape(-1))
    except av.FFmpegError as exc:
        raise unreadable(f"FFmpeg: {exc.strerror or type(exc).__name__}") from None
    samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    return samples.reshape(-1, 1), SAMPLE_RATE


def decode(data: bytes, limits: AudioLimits) -> Audio:
    """The audio in `data` as mono 16 kHz samples, within the limits (GatewayError)."""
    import numpy as np  # NOTE: in a worker thread (api/audio.py), preload.py

    if len(data) > limits.max_bytes:
        raise too_large(len(data), limits)
    if not data:
        raise unreadable("an empty file")
    found = _pcm_wav(data, limits) if data[:4] == b"RIFF" and data[8:12] == b"WAVE" else None
    if found is None:
        found = _container(data, limits) if _is_container(data) else _soundfile(data, limits)
    samples, rate = found
    if samples.size == 0:
        raise unreadable("no samples")
    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    if rate != SAMPLE_RATE:
        import soxr

        mono = soxr.resample(mono, rate, SAMPLE_RATE)
    mono = np.ascontiguousarray(mono, dtype=np.float32)
    if not np.isfinite(mono).all():
        raise unreadable("samples that are not finite numbers")
    return Audio(np.clip(mono, -1.0, 1.0))
