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
(`max_audio_bytes`, 413), its length (`max_audio_seconds`, 400) and its rate (at most
MAX_RATE). The samples are then read in blocks of a second, each mixed to mono and resampled
to 16 kHz as it comes, so what the decoder holds is bounded by the output (mono 16 kHz),
whatever the file's channels and rate claim: a 30 KB FLAC declaring 599 s at 96 kHz x 8
channels took the gateway to 2.2 GiB read whole (issue 43). Anything unreadable is a 400
naming the field `file`. Decoding is CPU work: callers run `decode` in a thread.
"""

from __future__ import annotations

import io
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from npu_proxy.gateway.core.errors import GatewayError, invalid

if TYPE_CHECKING:
    import numpy as np

SAMPLE_RATE = 16_000
# The shortest audio transcribed: 0.1 s, as OpenAI's limit.
MIN_SAMPLES = SAMPLE_RATE // 10
# NOTE: the highest rate of common audio (DXD is 352.8 kHz); a header claiming more (4 GHz
# was sent) is refused rather than resampled for seconds.
MAX_RATE = 384_000
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
        """The samples as little-endian float32 bytes (protocol/speech.py Transcribe.audio),
        without a copy: a view of the array, which msgpack encodes as the bytes it holds.
        NOTE: 600 s is 37 MiB a copy; the gateway held the samples twice more before."""
        samples = self.samples.astype("<f4", copy=False)
        return cast(bytes, samples.data.cast("B"))


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


def _pcm_wav(data: bytes, limits: AudioLimits) -> np.ndarray[Any, Any] | None:
    """Integer PCM WAV through `wave`, as mono 16 kHz; None for a WAV that `wave` does not
    read (float)."""
    try:
        with wave.open(io.BytesIO(data)) as wav:
            channels, width, rate = wav.getnchannels(), wav.getsampwidth(), wav.getframerate()
            frames = wav.getnframes()
            _check_header(rate, channels, frames, limits)
            if width not in (1, 2, 3, 4):
                raise unreadable(f"{8 * width}-bit WAV samples")
            blocks = (_wav_samples(raw, width).reshape(-1, channels)
                      for raw in iter(lambda: wav.readframes(rate), b""))
            return _mono_16k(blocks, rate, limits)
    except (wave.Error, EOFError) as exc:
        if "unknown format" in str(exc):
            return None  # NOTE: float or compressed WAV: libsndfile reads those.
        raise unreadable(f"a broken WAV file: {exc}") from None


def _wav_samples(raw: bytes, width: int) -> np.ndarray[Any, Any]:
    """Integer PCM frames of `width` bytes as float32 in [-1, 1)."""
    import numpy as np

    if width == 3:
        b = np.frombuffer(raw[:len(raw) // 3 * 3], np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8
        samples = ints.astype(np.float32) / float(1 << 23)
    else:
        kind: Any = {1: np.dtype(np.uint8), 2: np.dtype("<i2"), 4: np.dtype("<i4")}[width]
        ints = np.frombuffer(raw[:len(raw) // width * width], kind)
        if width == 1:
            samples = (ints.astype(np.float32) - 128.0) / 128.0
        else:
            samples = ints.astype(np.float32) / float(1 << (8 * width - 1))
    return samples


def _check_header(rate: int, channels: int, frames: int, limits: AudioLimits) -> None:
    """What a header declares, against the limits, before any sample is read."""
    if rate <= 0 or channels <= 0:
        raise unreadable("a header without a rate or channels")
    if rate > MAX_RATE:
        raise unreadable(f"a sample rate of {rate} Hz (at most {MAX_RATE})")
    if frames > 0 and frames / rate > limits.max_seconds:
        raise _too_long(frames / rate, limits)


def _mono_16k(blocks: Iterator[np.ndarray[Any, Any]], rate: int,
              limits: AudioLimits) -> np.ndarray[Any, Any]:
    """Blocks of (frames, channels) samples at `rate`, each mixed to mono and resampled to
    16 kHz as it comes; more than the limit's seconds is refused as soon as it is read."""
    import numpy as np
    import soxr

    stream = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32") \
        if rate != SAMPLE_RATE else None
    most, frames = int(limits.max_seconds * rate) + 1, 0
    out: list[np.ndarray[Any, Any]] = []
    for block in blocks:
        frames += len(block)
        if frames > most:
            raise _too_long(frames / rate, limits)
        mono = block.mean(axis=1, dtype=np.float32) if block.shape[1] > 1 else block[:, 0]
        mono = np.ascontiguousarray(mono, dtype=np.float32)
        out.append(stream.resample_chunk(mono) if stream is not None else mono)
    if stream is not None:
        out.append(stream.resample_chunk(np.zeros(0, np.float32), last=True))
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def _soundfile(data: bytes, limits: AudioLimits) -> np.ndarray[Any, Any]:
    try:
        import soundfile
    except ImportError:  # NOTE: a dependency; without it only PCM WAV is read
        raise unreadable("only PCM WAV is read without the soundfile package") from None
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as sound:
            rate = int(sound.samplerate)
            _check_header(rate, sound.channels, sound.frames, limits)
            # NOTE: some formats (MP3) may not know their length: _mono_16k bounds it.
            return _mono_16k(sound.blocks(blocksize=rate, dtype="float32", always_2d=True),
                             rate, limits)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        # NOTE: libsndfile's message names the in-memory file object; only its reason helps.
        raise unreadable(str(exc).rsplit(": ", 1)[-1] or type(exc).__name__) from None


def _container(data: bytes, limits: AudioLimits) -> np.ndarray[Any, Any]:
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
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def decode(data: bytes, limits: AudioLimits) -> Audio:
    """The audio in `data` as mono 16 kHz samples, within the limits (GatewayError)."""
    import numpy as np  # NOTE: in a worker thread (api/audio.py), preload.py

    if len(data) > limits.max_bytes:
        raise too_large(len(data), limits)
    if not data:
        raise unreadable("an empty file")
    mono = _pcm_wav(data, limits) if data[:4] == b"RIFF" and data[8:12] == b"WAVE" else None
    if mono is None:
        mono = _container(data, limits) if _is_container(data) else _soundfile(data, limits)
    if mono.size == 0:
        raise unreadable("no samples")
    if mono.size < MIN_SAMPLES:
        # NOTE: OpenAI's answer; Whisper's features need more than 200 samples (a 500 before).
        raise invalid(f"Audio file is too short. Minimum audio length is "
                      f"{MIN_SAMPLES / SAMPLE_RATE} seconds.", param="file")
    mono = np.ascontiguousarray(mono, dtype=np.float32)
    if not np.isfinite(mono).all():
        raise unreadable("samples that are not finite numbers")
    # NOTE: in place: 600 s is 38 MB a copy, and the gateway holds only what it must.
    if not mono.flags.writeable:
        mono = mono.copy()
    return Audio(np.clip(mono, -1.0, 1.0, out=mono))
