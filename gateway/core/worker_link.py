"""What the gateway knows of one worker: its sockets, its last heartbeat, the supervisor's
status of it and its requests in flight (the Broker, gateway/core/broker.py, owns the
sockets and fills these in).

A worker's state (`WorkerLink.state`) is decided here and only here for the gateway: the
supervisor's state of it, unless the gateway itself no longer hears the worker. /health/*
and /metrics read that property, so they name the same state as `npx-supervisor status`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import zmq.asyncio

from npu_proxy.gateway.core.request_stream import RequestStream
from npu_proxy.protocol.config import WorkerSpec
from npu_proxy.protocol.liveness import Heartbeat, WorkerStatus
from npu_proxy.protocol.states import ProcessState, observed, reported, silence_allowed, transition


class WorkerUnavailable(Exception):
    pass


@dataclass
class WorkerLink:
    spec: WorkerSpec
    push: zmq.asyncio.Socket
    sub: zmq.asyncio.Socket
    heartbeat: Heartbeat | None = None
    seen_at: float = 0.0
    # The supervisor's state of the worker (its process, restarts, last error).
    supervised: WorkerStatus | None = None
    # monotonic time the supervisor first named its current process (supervised.pid).
    pid_since: float = field(default_factory=time.monotonic)
    requests: dict[str, RequestStream] = field(default_factory=dict)
    # How long the worker may be silent inside one pipeline step (a long prefill): the longest
    # a request may take. The supervisor, which reads its CPU time, says UNRESPONSIVE sooner
    # when it is stopped or deadlocked rather than computing (supervisor/liveness.py).
    busy_limit: float = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        """The worker's current process (0: none), as the supervisor names it."""
        if self.supervised is not None:
            return self.supervised.pid
        return self.heartbeat.pid if self.heartbeat is not None else 0

    @property
    def state(self) -> ProcessState:
        """The one state of this worker that /health/* and /metrics report."""
        if self.supervised is not None:
            state = self.supervised.state
        else:
            # NOTE: only until the supervisor's first status reaches a (re)started gateway
            # (it sends one a second): the heartbeat, read through the same table.
            state = ProcessState.STARTING
            if self.heartbeat is None and self.spec.lazy:
                state = ProcessState.IDLE  # NOTE: the supervisor starts lazy workers later
            event = reported(self.heartbeat.state) if self.heartbeat is not None else None
            if event is not None:
                state = transition(state, event)
        return observed(state, self._fresh())

    def _fresh(self) -> bool:
        """The gateway hears the current process, and it makes progress."""
        beat = self.heartbeat
        pid = self.pid
        if beat is None or beat.pid != pid:
            # NOTE: a process the supervisor named but this gateway has not heard yet (its
            # SUB reconnects to a new process within a heartbeat or two) gets one timeout.
            return time.monotonic() - self.pid_since < self.spec.heartbeat_timeout
        # NOTE: a worker stuck mid-generation still heartbeats; stop routing to it as soon
        # as it has made no progress for its stall timeout (the supervisor then restarts it).
        return (self.heartbeat_age() < self.silence_allowed()
                and beat.stalled_for <= self.spec.stall_timeout)

    def heartbeat_age(self) -> float:
        return time.monotonic() - self.seen_at if self.seen_at else float("inf")

    def silence_allowed(self) -> float:
        """Seconds without a heartbeat before this worker counts as hung (what its last
        heartbeat said decides: protocol/states.py)."""
        beat = self.heartbeat
        return silence_allowed(beat is not None and beat.blocking,
                               beat.stalled_for if beat is not None else 0.0,
                               self.spec.heartbeat_timeout,
                               max(self.spec.stall_timeout, self.busy_limit))

    @property
    def idle(self) -> bool:
        """Not loaded: a lazy worker without a process until a request needs it."""
        return self.state == ProcessState.IDLE

    @property
    def first_load(self) -> bool:
        """Loading a process the supervisor started, not one replacing a crashed process
        (`WorkerStatus.recovering`): at start, a lazy one on demand (also after an earlier
        crash, once it had stopped), an operator's start or restart. Another host's worker,
        which no supervisor of this gateway tells of, says so in its heartbeats."""
        # NOTE: a request waits for a first load (as Ollama's first request waits for the
        # model), and for a crash's restart (`reloading`) too; only /health/ready tells them
        # apart (gateway/core/health.py), so a balancer fails over to an instance that serves.
        told = self.supervised or self.heartbeat
        return told is not None and not told.recovering and self.state.loading

    @property
    def reloading(self) -> bool:
        """Replacing a crashed process: waiting to restart (backoff) or loading the new one
        (`WorkerStatus.recovering`). Requests wait for it, as for a first load (issue 43)."""
        told = self.supervised or self.heartbeat
        return self.state == ProcessState.BACKOFF or (
            told is not None and told.recovering and self.state.loading)

    @property
    def serving(self) -> bool:
        # NOTE: only once the gateway has heard the process itself say it serves: that proves
        # its SUB is connected (a request's frames are not lost), and every observer of that
        # heartbeat (the metrics' load time) saw it before the supervisor's "ready" counts.
        beat = self.heartbeat
        return (self.state.serving and beat is not None and beat.pid == self.pid
                and beat.state.serving)
