"""Is a silent worker busy or hung? Its CPU time, read from the OS, says what it cannot fake.

A worker inside a pipeline call that holds the GIL (a long prefill in the llm role's
ContinuousBatchingPipeline.step()) sends no heartbeat until the call returns, and neither does
a worker that is stopped (SIGSTOP, a debugger) or deadlocked inside native code. The first
burns CPU, the others do not: the supervisor samples each worker's CPU time (`CpuWatch`) and
declares a silent worker hung once it has used next to none for `heartbeat_timeout`.

    Linux    /proc/<pid>/stat: utime + stime, and the state letter (T/t: stopped, traced)
    Windows  GetProcessTimes (kernel + user) through ctypes
    else     no reading: the supervisor keeps the stall_timeout rule for a silent busy worker

NOTE: why not a heartbeat from a thread that never needs the GIL (a native thread, or
ZeroMQ's own ZMTP heartbeats)? It would tell a stopped process from a running one, but not
a deadlock inside native code from a long prefill: both are a running process whose Python
threads are silent. CPU time tells all three apart, needs no native code in the worker, and
is read by the process that does the killing, from the kernel.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

# NOTE: a worker deadlocked in native code with the GIL held still uses a little CPU: each
# thread waiting for the GIL wakes every switch interval (5 ms) to ask for it. Measured here:
# 0.8 % of one core with 3 waiting threads. A prefill uses a whole core or more (a twentieth
# is what it gets among 40 busy threads on 2 cores).
CPU_FLOOR = 0.05
STOPPED = "stopped by a signal or a debugger (process state T)"
# Seconds between two samples of one worker (a read of /proc costs ~20 us).
SAMPLE_EVERY = 0.2


@dataclass(frozen=True)
class CpuReading:
    """One look at a process: CPU seconds used so far (user + system, all threads), and
    whether the OS holds it stopped (SIGSTOP, or stopped under a tracer)."""

    cpu_seconds: float
    stopped: bool


def _read_linux(pid: int) -> CpuReading | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # NOTE: fields after the command name, which is in parentheses and may hold spaces and
    # parentheses itself: the last ')' ends it. Then state (field 3), ..., utime (14), stime (15).
    fields = stat.rsplit(")", 1)[1].split()
    state = fields[0]
    if state in ("Z", "X"):
        return None
    ticks = int(fields[11]) + int(fields[12])
    return CpuReading(cpu_seconds=ticks / _CLOCK_TICKS, stopped=state in ("T", "t"))


if sys.platform == "win32":
    import ctypes
    from ctypes import wintypes

    _PROCESS_QUERY_LIMITED_INFORMATION = 0x1000

    def _read_windows(pid: int) -> CpuReading | None:
        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
        handle = kernel32.OpenProcess(_PROCESS_QUERY_LIMITED_INFORMATION, False, pid)
        if not handle:
            return None
        try:
            created, exited, kernel, user = (wintypes.FILETIME() for _ in range(4))
            if not kernel32.GetProcessTimes(handle, ctypes.byref(created), ctypes.byref(exited),
                                            ctypes.byref(kernel), ctypes.byref(user)):
                return None
            hundred_ns = sum((t.dwHighDateTime << 32) | t.dwLowDateTime for t in (kernel, user))
            # NOTE: Windows has no SIGSTOP; a suspended process simply uses no CPU.
            return CpuReading(cpu_seconds=hundred_ns / 1e7, stopped=False)
        finally:
            kernel32.CloseHandle(handle)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if sys.platform.startswith("linux") else 100


def read_cpu(pid: int) -> CpuReading | None:
    """The OS's view of process `pid`, or None: gone, unreadable, or no reader on this OS."""
    if sys.platform.startswith("linux"):
        return _read_linux(pid)
    if sys.platform == "win32":
        return _read_windows(pid)
    return None


class CpuWatch:
    """The recent CPU readings of one worker process, sampled by the supervisor's loop."""

    def __init__(self, pid: int, keep: float) -> None:
        self.pid = pid
        # Seconds of history kept: the longest window asked about, plus a sample's spacing.
        self.keep = keep + 2 * SAMPLE_EVERY
        self.samples: deque[tuple[float, CpuReading]] = deque()

    def sample(self, now: float) -> None:
        if self.samples and now - self.samples[-1][0] < SAMPLE_EVERY:
            return
        reading = read_cpu(self.pid)
        if reading is None:
            return
        self.samples.append((now, reading))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.keep:
            self.samples.popleft()

    @property
    def stopped(self) -> bool:
        """Did the last reading find the process stopped by the OS?"""
        return bool(self.samples) and self.samples[-1][1].stopped

    def hung(self, window: float) -> str | None:
        """Why the process counts as hung over the last `window` seconds, or None: it is not
        (it used CPU), or that cannot be told (no reader here, not watched that long yet)."""
        if not self.samples:
            return None
        now, last = self.samples[-1]
        if last.stopped:
            return STOPPED
        start = next(((t, r) for t, r in reversed(self.samples) if now - t >= window), None)
        if start is None:
            return None
        then, first = start
        used = last.cpu_seconds - first.cpu_seconds
        if used < CPU_FLOOR * (now - then):
            return f"used {used:.2f} s of CPU in {now - then:.1f} s"
        return None
