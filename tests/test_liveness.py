"""The supervisor's reading of a process's CPU time and OS state (supervisor/liveness.py), on
real child processes: a stopped process reads stopped and its CPU time stands still."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from serverctl import wait_for

from npu_proxy.supervisor.liveness import CpuReading, CpuWatch, read_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc (Linux)")


@pytest.fixture
def spinner() -> Iterator[subprocess.Popen[bytes]]:
    """A child that computes until killed."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield proc
    proc.kill()
    proc.wait()


def _cpu(pid: int) -> float:
    reading = read_cpu(pid)
    assert reading is not None
    return reading.cpu_seconds


def test_a_stopped_process_reads_stopped_and_its_cpu_time_stands_still(
        spinner: subprocess.Popen[bytes]) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        first = read_cpu(sleeper.pid)
        assert first is not None and not first.stopped
        os.kill(sleeper.pid, signal.SIGSTOP)
        stopped = wait_for(lambda: (r := read_cpu(sleeper.pid)) is not None and r.stopped and r,
                           what="the stopped child never read as stopped")
        # The clock that shows time passing: another process's CPU time, a fifth of a second.
        start = _cpu(spinner.pid)
        wait_for(lambda: _cpu(spinner.pid) - start >= 0.2, every=0.02)
        later = read_cpu(sleeper.pid)
        assert later == CpuReading(cpu_seconds=stopped.cpu_seconds, stopped=True)
        os.kill(sleeper.pid, signal.SIGCONT)
        wait_for(lambda: (r := read_cpu(sleeper.pid)) is not None and not r.stopped)
    finally:
        sleeper.kill()
        sleeper.wait()
    # Gone (reaped): nothing to read, so no verdict either way.
    assert read_cpu(sleeper.pid) is None


def test_a_computing_process_is_not_hung_and_a_stopped_one_is(
        spinner: subprocess.Popen[bytes]) -> None:
    watch = CpuWatch(spinner.pid, keep=1.0)
    start = _cpu(spinner.pid)
    wait_for(lambda: _cpu(spinner.pid) - start >= 0.1, every=0.02)
    # NOTE: sampled at made-up times, one window apart: what is judged is the CPU time the OS
    # reports between two samples against the time between them.
    watch.sample(100.0)
    wait_for(lambda: _cpu(spinner.pid) - watch.samples[-1][1].cpu_seconds >= 0.1, every=0.02)
    watch.sample(101.0)
    assert watch.hung(1.0) is None
    # Not watched for a whole window yet: no verdict.
    assert CpuWatch(spinner.pid, keep=1.0).hung(1.0) is None
    os.kill(spinner.pid, signal.SIGSTOP)
    wait_for(lambda: (r := read_cpu(spinner.pid)) is not None and r.stopped)
    watch.sample(101.5)
    assert watch.stopped
    assert "stopped" in (watch.hung(1.0) or "")


def test_a_process_that_uses_no_cpu_for_a_window_is_hung() -> None:
    """A deadlock holds no stopped state: its CPU time simply stops moving."""
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; print('asleep', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE)
    try:
        assert sleeper.stdout is not None and sleeper.stdout.readline() == b"asleep\n"
        # NOTE: sampled at made-up times: a sleeping process adds no CPU time between them.
        watch = CpuWatch(sleeper.pid, keep=2.0)
        watch.sample(10.0)
        watch.sample(11.0)
        assert watch.hung(2.0) is None  # not watched for a whole window yet
        watch.sample(12.5)
        why = watch.hung(2.0)
        assert why is not None and "CPU" in why and not watch.stopped
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_worker_computing_in_one_long_step_may_be_silent_as_long_as_a_request_may(
        spinner: subprocess.Popen[bytes]) -> None:
    """A 7,900-token prefill on a loaded 2-core machine kept the llm worker silent in one
    step for over 120 s (its stall_timeout) and got it killed; its CPU time shows it computing,
    so it may take as long as a request may (inference_timeout), and no longer."""
    from npu_proxy.protocol.config import WorkerSpec
    from npu_proxy.protocol.states import ProcessState
    from npu_proxy.supervisor.children import Child

    child = Child("llm", "llm", [], None, echo=False)  # type: ignore[arg-type]
    child.proc = spinner
    child.state = ProcessState.BUSY
    child.blocking = True
    spec = WorkerSpec(name="llm", heartbeat_timeout=10.0, stall_timeout=120.0)
    now = 1000.0
    child.heartbeat_at = now - 130.0
    assert child.hang_reason(spec, now, busy_limit=600.0) is None
    assert "no progress" in (child.hang_reason(spec, now + 1, busy_limit=120.0) or "")
    child.heartbeat_at = now - 601.0
    assert "no progress" in (child.hang_reason(spec, now + 2, busy_limit=600.0) or "")
