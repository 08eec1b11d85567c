"""The children's log files: a size-capped, rotated writer that never stops draining, and
the tail reader behind `npx-supervisor logs`.

A child writes to a pipe; the supervisor's tee thread copies each line into
`<runtime>/logs/<name>.log`. If that copy stopped (a full disk, a removed folder), the pipe
would fill, the child would block on its next log line and the supervisor would kill it as
stalled, again and again. So a write error drops the line (counted, reported once) and the
next line tries again; nothing a file system does can stop the drain.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

# NOTE: a child that prints without newlines must not make the tee buffer it all.
MAX_LINE = 64 * 1024
_TAIL_BLOCK = 64 * 1024


class RotatingLog:
    """Appends lines to `path`; past `max_bytes` it becomes `path.1` (`.1` becomes `.2`, …,
    `backups` kept). Never raises on write: failures drop the line and are counted."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.dropped = 0
        self._out: IO[bytes] | None = None
        self._size = 0

    def _open(self) -> IO[bytes]:
        if self._out is None:
            self._out = open(self.path, "ab", buffering=0)  # noqa: SIM115
            self._size = os.fstat(self._out.fileno()).st_size
        return self._out

    def _rotate(self) -> None:
        self.close()
        for n in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{n}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{n + 1}"))
        if self.backups > 0:
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)

    def write(self, line: bytes) -> None:
        try:
            out = self._open()
            if self._size and self._size + len(line) > self.max_bytes:
                self._rotate()
                out = self._open()
            out.write(line)
            self._size += len(line)
        except OSError as exc:
            self.close()
            self.dropped += 1
            if self.dropped == 1:
                log.error("cannot write log %s (%s); dropping its lines until it works again",
                          self.path, exc)

    def close(self) -> None:
        if self._out is not None:
            with contextlib.suppress(OSError):
                self._out.close()
            self._out = None


def tee(stream: IO[bytes], out: RotatingLog, echo: bool) -> None:
    """Copy a child's output into its log (and to stderr when echoing) until it closes."""
    try:
        for line in iter(lambda: stream.readline(MAX_LINE), b""):
            out.write(line)
            if echo:
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.buffer.write(line)
                    sys.stderr.buffer.flush()
    finally:
        out.close()


def tail(path: Path, lines: int) -> list[bytes]:
    """The last `lines` lines of a file, reading blocks from its end (never the whole file)."""
    if lines <= 0:
        return []
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        data = b""
        pos = end
        while pos > 0 and data.count(b"\n") <= lines:
            step = min(_TAIL_BLOCK, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    found = data.splitlines(keepends=True)
    return found[-lines:]


def follow(path: Path, poll: float = 0.25) -> Iterator[bytes]:
    """New lines appended to `path` from this call on, across rotations (the file is
    reopened when a new one takes its place). Runs until the caller stops iterating."""
    f = open(path, "rb")  # noqa: SIM115
    f.seek(0, os.SEEK_END)
    return _follow(f, path, poll)


def _follow(f: IO[bytes], path: Path, poll: float) -> Iterator[bytes]:
    try:
        partial = b""
        while True:
            chunk = f.read(_TAIL_BLOCK)
            if chunk:
                partial += chunk
                *done, partial = partial.split(b"\n")
                for line in done:
                    yield line + b"\n"
                continue
            try:
                rotated = os.stat(path).st_ino != os.fstat(f.fileno()).st_ino
            except FileNotFoundError:
                rotated = False
            if rotated:
                f.close()
                f = open(path, "rb")  # noqa: SIM115
                continue
            time.sleep(poll)
    finally:
        f.close()
