"""One supervised child process: spawn, state, backoff, graceful stop.

Its state is a `ProcessState` and changes only through `Child.apply`, by the transition
table of protocol/states.py; worker states between starting and busy come from the worker's
heartbeats, the others from the supervisor's own decisions.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque

from npu_proxy.protocol.config import WorkerSpec
from npu_proxy.protocol.states import Event, ProcessState, silence_allowed, transition
from npu_proxy.supervisor.liveness import STOPPED, CpuWatch
from npu_proxy.supervisor.logfiles import RotatingLog, tee

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: Linux sends SIGKILL to it when the supervisor dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # NOTE: not Linux; the supervisor's own exit path stops its children.


class Child:
    def __init__(self, name: str, kind: str, argv: list[str], log: RotatingLog,
                 echo: bool) -> None:
        self.name = name
        self.kind = kind  # "gateway" or the worker role
        self.argv = argv
        self.log = log
        self.echo = echo
        self.proc: subprocess.Popen[bytes] | None = None
        self.state = ProcessState.STOPPED
        self.started_at = 0.0
        self.restarts = 0
        # The process runs (or is about to) in place of one that crashed: the supervisor is
        # recovering the worker. False for a first start (at start-up, a lazy worker started
        # on demand, an operator's start) and for a restart or switch it was told to do.
        self.recovering = False
        self.crash_times: deque[float] = deque()
        self.last_error = ""
        self.next_start = 0.0
        self.expected_exit = False
        self.hold = False
        # Told to stop for idling (control.Unload): its exit makes it idle, not a restart.
        self.unloading = False
        self.kill_at = 0.0
        self.heartbeat_at = 0.0
        self.stalled_for = 0.0
        # What the last heartbeat said (protocol/states.py silence_allowed).
        self.blocking = False
        # The current process's CPU time, sampled while it serves (supervisor/liveness.py).
        self.cpu: CpuWatch | None = None
        self.model = ""
        self.device = ""

    @property
    def pid(self) -> int | None:
        # NOTE: returncode, not poll(): reaping is the supervisor loop's job, so that every
        # exit goes through its exit handling.
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    def spawn(self) -> None:
        # NOTE: the worker says so in its heartbeats, for gateways this supervisor does not
        # tell (another host's: gateway/core/broker.py WorkerLink.first_load).
        recovering = ["--recovering"] if self.recovering and self.kind != "gateway" else []
        self.proc = subprocess.Popen(
            self.argv + recovering,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
            # NOTE: own session, so a terminal's Ctrl-C reaches only the supervisor, which then
            # stops the children in order instead of racing their restarts.
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        threading.Thread(target=tee, args=(self.proc.stdout, self.log, self.echo),
                         name=f"tee-{self.name}", daemon=True).start()
        # NOTE: workers report their own states in heartbeats; the gateway has none.
        self.apply(Event.SPAWN_SILENT if self.kind == "gateway" else Event.SPAWN)
        self.started_at = time.monotonic()
        self.heartbeat_at = 0.0
        self.stalled_for = 0.0
        self.blocking = False
        self.cpu = None
        self.expected_exit = False
        self.unloading = False
        self.kill_at = 0.0
        log.info("started %s pid %d", self.name, self.proc.pid)

    def apply(self, event: Event) -> ProcessState:
        """Move to the state the transition table gives for `event`; returns it."""
        new = transition(self.state, event)
        if new != self.state:
            log.debug("%s: %s -> %s (%s)", self.name, self.state.label, new.label, event.value)
            self.state = new
        return new

    def hang_reason(self, spec: WorkerSpec, now: float, busy_limit: float) -> str | None:
        """Why this worker counts as hung now (the supervisor then kills it), or None.
        `busy_limit`: how long a worker silent inside a pipeline step, and computing by its
        CPU time, may stay silent (the longest a request may take)."""
        if self.state.loading:
            # NOTE: a native compile may hold the GIL and silence heartbeats for minutes, so
            # while loading only the load deadline applies.
            if now - self.started_at > spec.load_timeout:
                return f"stuck {self.state.label} for more than {spec.load_timeout:.0f} s"
            return None
        cpu = self._sample_cpu(spec, now)
        silent = now - self.heartbeat_at if self.heartbeat_at else 0.0
        # NOTE: where CPU time can be read, a silent worker that is not computing is caught
        # below within heartbeat_timeout, so one that is computing gets the longer limit.
        limit = spec.stall_timeout if cpu is None or not cpu.samples else max(
            spec.stall_timeout, busy_limit)
        if silent > silence_allowed(self.blocking, self.stalled_for, spec.heartbeat_timeout,
                                    limit):
            if self.blocking:
                return (f"no progress for {self.stalled_for + silent:.0f} s while busy "
                        "(silent inside one pipeline step)")
            stopped = f", {STOPPED}" if cpu is not None and cpu.stopped else ""
            return f"no heartbeat for {silent:.1f} s{stopped}"
        if self.blocking and silent > spec.heartbeat_timeout and cpu is not None:
            # NOTE: silent inside a pipeline step, as a long prefill is, but not computing:
            # stopped or deadlocked. Waiting for stall_timeout would hold its requests (and
            # every request routed to it meanwhile) for minutes.
            why = cpu.hung(spec.heartbeat_timeout)
            if why is not None:
                return f"hung: no heartbeat for {silent:.1f} s while busy, {why}"
        if self.stalled_for > spec.stall_timeout:
            return f"no progress for {self.stalled_for:.0f} s while busy"
        return None

    def _sample_cpu(self, spec: WorkerSpec, now: float) -> CpuWatch | None:
        """The serving process's CPU time, sampled now and then (supervisor/liveness.py)."""
        pid = self.pid
        if pid is None or not self.state.serving:
            return None
        if self.cpu is None or self.cpu.pid != pid:
            self.cpu = CpuWatch(pid, keep=spec.heartbeat_timeout)
        self.cpu.sample(now)
        return self.cpu

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def uptime(self) -> float:
        return time.monotonic() - self.started_at if self.pid else 0.0
