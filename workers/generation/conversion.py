"""A GGUF file converted to IR in a child process (issue 29), so the worker keeps none of it.

Converting (OpenVINO GenAI's GGUF reader, the graph rewrite and its check at each precision:
workers/gguf_ir.py) raises a worker's peak RSS well above a load of the converted IR, and the
C heap keeps much of it for the worker's whole life even after the warm-up's trim
(Qwen2.5-Coder-1.5B Q4_K_M: 130-170 MiB more; docs/performance.md). So the worker runs it in
a fresh interpreter, `python -m npu_proxy.workers.gguf_ir GGUF DONE STAGING PARENT` (its
`main`, which calls `child_main` here), never a fork (OpenVINO's threads) and with nothing
but paths passed: the result is the folder DONE on disk, renamed there from STAGING only
once complete. This module imports nothing of gguf_ir, which imports it.

While it waits, the worker stays `loading` (heartbeats go on, the supervisor's load_timeout
covers the conversion); a stop (SIGTERM) ends the child at once and removes its staging
folder; a worker killed outright takes the child with it (PR_SET_PDEATHSIG). The child's log
lines come through the worker's own log, under the logger that wrote them.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# NOTE: seconds a child told to stop (SIGTERM) has before it is killed; it holds no state
# worth a clean exit (its staging folder is removed either way).
_STOP_GRACE = 2.0
# The child's log lines: "<logger> <LEVEL> <message>" (other output, OpenVINO's own, as is).
_FORMAT = "%(name)s %(levelname)s %(message)s"


class ConversionStopped(RuntimeError):
    """The worker was told to stop while a conversion ran; the conversion was ended."""


class ConversionFailed(RuntimeError):
    """The child ended without a complete folder; the message ends with its last lines."""


def convert_in_child(entry: str, gguf: Path, done: Path, stop: threading.Event | None = None,
                     hang: bool = False) -> None:
    """Convert `gguf` into the folder `done` in a child process running the module `entry`
    (workers/gguf_ir.py, whose main calls `child_main`) and wait for it; ConversionStopped
    once `stop` is set (the child is ended first), ConversionFailed when it ends without
    making `done`. `hang`: the test fault hook
    `hang_in_conversion`."""
    staging = done.with_name(f"{done.name}.{os.getpid()}.partial")
    argv = [sys.executable, "-m", entry, str(gguf), str(done), str(staging),
            str(os.getpid())] + (["--hang"] if hang else [])
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    log.info("converting %s in child process %d", gguf.name, child.pid)
    assert child.stdout is not None
    tail: collections.deque[str] = collections.deque(maxlen=12)
    relay = threading.Thread(target=_relay, args=(child.stdout, tail), daemon=True,
                             name="conversion-log")
    relay.start()
    try:
        while child.poll() is None:
            if stop is not None and stop.is_set():
                _end(child)
                raise ConversionStopped(f"stopped while converting {gguf.name}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(0.1)
    finally:
        if child.poll() is None:
            _end(child)  # NOTE: whatever ended the wait (an exception, KeyboardInterrupt)
        relay.join(1.0)
        # NOTE: a child that was ended or crashed never ran its own clean-up.
        shutil.rmtree(staging, ignore_errors=True)
    if child.returncode != 0 or not done.is_dir():
        last = "\n".join(tail)
        raise ConversionFailed(
            f"converting {gguf.name} failed in child process {child.pid} (exit status "
            f"{child.returncode}): {last}")


def _end(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM, a short grace, then SIGKILL; reaped."""
    child.terminate()
    try:
        child.wait(_STOP_GRACE)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    log.info("conversion child %d ended", child.pid)


def _relay(stream: IO[bytes], tail: collections.deque[str]) -> None:
    """The child's output into this process's log, each line under the logger and at the
    level the child wrote it with; the last lines kept for an error message."""
    level = logging.INFO
    for raw in stream:
        line = raw.decode(errors="replace").rstrip()
        if not line:
            continue
        name, _, rest = line.partition(" ")
        named, _, message = rest.partition(" ")
        target = log
        if name.startswith("npu_proxy.") and named in logging.getLevelNamesMapping():
            level, target = logging.getLevelNamesMapping()[named], logging.getLogger(name)
        else:
            message = line  # a traceback's next line, or OpenVINO's own output
        target.log(level, "%s", message)
        tail.append(message)
    stream.close()


def _die_with(parent: int) -> None:
    """Linux SIGKILLs this process when the worker that started it dies (even by SIGKILL);
    exit now if that already happened."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # NOTE: the worker may have died before prctl: then this process was re-parented.
    if os.getppid() != parent:
        os._exit(1)


def child_main(argv: list[str], convert: Callable[[Path, Path, Path, bool], None],
               log_to: logging.Logger) -> int:
    """The child's side: `GGUF DONE STAGING PARENT [--hang]` converted by `convert`, dying
    with the worker PARENT; 1 (logged) when the conversion fails."""
    hang = "--hang" in argv
    gguf, done, staging, parent = [a for a in argv if a != "--hang"]
    _die_with(int(parent))
    logging.basicConfig(level=logging.INFO, format=_FORMAT, stream=sys.stderr)
    try:
        convert(Path(gguf), Path(done), Path(staging), hang)
    except Exception:
        log_to.exception("could not convert %s", Path(gguf).name)
        return 1
    return 0
