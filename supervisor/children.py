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

from npu_proxy.protocol.states import Event, ProcessState, transition
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
        self.crash_times: deque[float] = deque()
        self.last_error = ""
        self.next_start = 0.0
        self.expected_exit = False
        self.hold = False
        self.kill_at = 0.0
        self.heartbeat_at = 0.0
        self.stalled_for = 0.0
        # What the last heartbeat said (protocol/states.py silence_allowed).
        self.blocking = False
        self.model = ""
        self.device = ""

    @property
    def pid(self) -> int | None:
        # NOTE: returncode, not poll(): reaping is the supervisor loop's job, so that every
        # exit goes through its exit handling.
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    def spawn(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
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
        self.expected_exit = False
        self.kill_at = 0.0
        log.info("started %s pid %d", self.name, self.proc.pid)

    def apply(self, event: Event) -> ProcessState:
        """Move to the state the transition table gives for `event`; returns it."""
        new = transition(self.state, event)
        if new != self.state:
            log.debug("%s: %s -> %s (%s)", self.name, self.state.label, new.label, event.value)
            self.state = new
        return new

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def uptime(self) -> float:
        return time.monotonic() - self.started_at if self.pid else 0.0
