"""Process states and their transitions: one vocabulary for every process npu-proxy runs.

The supervisor owns the state of each child and changes it only through `transition`, which
reads the one table below (event x state -> state, as supervisord and circus document theirs).
Workers report their own progress in heartbeats (loading, warming, ready, busy, draining);
the supervisor turns each report into an event of the table, so a late or out-of-order
heartbeat cannot undo what the supervisor decided (a worker being drained stays draining).
The supervisor publishes the result (`WorkerStatus`), and the gateway's /health/*, /metrics
and `npx-supervisor status` all name a worker's state with `ProcessState.label`.

    starting -> loading -> warming -> ready <-> busy     (reported by the worker)
    any of those  --terminate-->  draining               (stop, drained restart, switch)
    any of those  --hung------->  unresponsive           (killed by the supervisor)
    any live one  --exit------->  backoff -> starting | stopped (held) | failed (crash loop)
    idle --spawn--> starting ... ready --terminate--> draining --exit_idle--> idle
                                                      (a lazy worker: not loaded until needed)

The numbering is the wire format of `Heartbeat.state`: append, never renumber.
"""

from __future__ import annotations

import enum


class ProcessState(enum.IntEnum):
    """The life-cycle state of one supervised process (a worker or the gateway)."""

    # Spawned; has not reported yet.
    STARTING = 0
    # Loading (compiling) its model; only the load deadline applies, not the heartbeat one.
    LOADING = 1
    # Model loaded, running a one-token warm-up generation.
    WARMING = 2
    # Serving, idle.
    READY = 3
    # Serving, with requests in flight.
    BUSY = 4
    # Told to stop (SIGTERM): finishing in-flight work within the grace period, then exits.
    DRAINING = 5
    # Not running and not restarted until an operator starts it (stop command, disabled).
    STOPPED = 6
    # Crash loop: more crashes than max_restarts within restart_window; an operator must act.
    FAILED = 7
    # Exited; waiting out the restart delay before it is spawned again.
    BACKOFF = 8
    # Alive, a process that reports no life cycle of its own (the gateway).
    RUNNING = 9
    # Alive but hung: past its load deadline, heartbeats stopped, or no progress while busy.
    # The supervisor kills it; the gateway also says so when it stops hearing a worker.
    UNRESPONSIVE = 10
    # Not loaded: a lazy worker that no request has needed yet, or that was stopped after
    # idling for its keep_alive. No process; the gateway starts it on the next request that
    # needs it. Neither down nor failed: it can serve, after a load.
    IDLE = 11

    @property
    def label(self) -> str:
        """The name every surface shows: /metrics, /health/devices, `npx-supervisor status`."""
        return self.name.lower()

    @property
    def serving(self) -> bool:
        return self in (ProcessState.READY, ProcessState.BUSY)

    @property
    def loading(self) -> bool:
        """States in which only the load deadline applies (a compile may silence heartbeats)."""
        return self in (ProcessState.STARTING, ProcessState.LOADING, ProcessState.WARMING)

    @property
    def alive(self) -> bool:
        """A process exists in this state (the others are between or after processes)."""
        return self not in (ProcessState.STOPPED, ProcessState.FAILED, ProcessState.BACKOFF,
                            ProcessState.IDLE)


class Event(enum.Enum):
    """What happens to a process; the supervisor picks the event, the table the state."""

    # The supervisor spawned a worker (it will report its states in heartbeats).
    SPAWN = "spawn"
    # The supervisor spawned a process that sends no heartbeats (the gateway).
    SPAWN_SILENT = "spawn_silent"
    # A heartbeat of the current process reported this state.
    REPORT_STARTING = "report_starting"
    REPORT_LOADING = "report_loading"
    REPORT_WARMING = "report_warming"
    REPORT_READY = "report_ready"
    REPORT_BUSY = "report_busy"
    REPORT_DRAINING = "report_draining"
    REPORT_STOPPED = "report_stopped"
    REPORT_FAILED = "report_failed"
    # The supervisor found it hung (load deadline, heartbeat timeout, stall) and kills it.
    HUNG = "hung"
    # The supervisor sent SIGTERM (stop, drained restart, model switch).
    TERMINATE = "terminate"
    # It exited and will be restarted (expected, or a crash within the restart limit).
    EXIT = "exit"
    # It exited while an operator holds it stopped.
    EXIT_HELD = "exit_held"
    # It exited after being stopped for idling past its keep_alive: not loaded, not a crash.
    EXIT_IDLE = "exit_idle"
    # It exited once too often within the restart window: the supervisor gives up.
    CRASH_LOOP = "crash_loop"
    # An operator stopped it while no process runs (in backoff, failed or idle).
    STOP = "stop"


_S = ProcessState
_WORKER_LIVE = (_S.STARTING, _S.LOADING, _S.WARMING, _S.READY, _S.BUSY)
_ALIVE = (*_WORKER_LIVE, _S.DRAINING, _S.RUNNING, _S.UNRESPONSIVE)
_DOWN = (_S.BACKOFF, _S.STOPPED, _S.FAILED, _S.IDLE)

# NOTE: states may be skipped (a supervisor that subscribes to a new worker's heartbeats
# late misses its first ones), so a report moves any earlier live state forward.
# A pair that is not listed leaves the state as it is: a late heartbeat of a worker being
# drained or killed, a REPORT_FAILED (the worker then exits, and the exit decides between
# backoff and failed), a stop of what is already stopped.
_ROWS: tuple[tuple[Event, tuple[ProcessState, ...], ProcessState], ...] = (
    # event                 from states                                      to state
    (Event.SPAWN,            _DOWN,                                           _S.STARTING),
    (Event.SPAWN_SILENT,     _DOWN,                                           _S.RUNNING),
    (Event.REPORT_LOADING,   (_S.STARTING,),                                  _S.LOADING),
    (Event.REPORT_WARMING,   (_S.STARTING, _S.LOADING),                       _S.WARMING),
    (Event.REPORT_READY,     (_S.STARTING, _S.LOADING, _S.WARMING, _S.BUSY),  _S.READY),
    (Event.REPORT_BUSY,      (_S.STARTING, _S.LOADING, _S.WARMING, _S.READY), _S.BUSY),
    (Event.REPORT_DRAINING,  _WORKER_LIVE,                                    _S.DRAINING),
    (Event.REPORT_STOPPED,   _WORKER_LIVE,                                    _S.DRAINING),
    (Event.HUNG,             _WORKER_LIVE,                                    _S.UNRESPONSIVE),
    (Event.TERMINATE,        (*_WORKER_LIVE, _S.RUNNING),                     _S.DRAINING),
    (Event.EXIT,             _ALIVE,                                          _S.BACKOFF),
    (Event.EXIT_HELD,        _ALIVE,                                          _S.STOPPED),
    (Event.EXIT_IDLE,        _ALIVE,                                          _S.IDLE),
    (Event.CRASH_LOOP,       _ALIVE,                                          _S.FAILED),
    (Event.STOP,             (_S.BACKOFF, _S.FAILED, _S.IDLE),                _S.STOPPED),
)

TRANSITIONS: dict[tuple[Event, ProcessState], ProcessState] = {
    (event, source): target for event, sources, target in _ROWS for source in sources
}

_REPORTS = {
    _S.STARTING: Event.REPORT_STARTING,
    _S.LOADING: Event.REPORT_LOADING,
    _S.WARMING: Event.REPORT_WARMING,
    _S.READY: Event.REPORT_READY,
    _S.BUSY: Event.REPORT_BUSY,
    _S.DRAINING: Event.REPORT_DRAINING,
    _S.STOPPED: Event.REPORT_STOPPED,
    _S.FAILED: Event.REPORT_FAILED,
}


def transition(state: ProcessState, event: Event) -> ProcessState:
    """The state after `event` in `state` (the same state where the event does not apply)."""
    return TRANSITIONS.get((event, state), state)


def reported(state: ProcessState) -> Event | None:
    """The event a heartbeat reporting `state` is (None for states only a supervisor sets)."""
    return _REPORTS.get(state)


def silence_allowed(blocking: bool, stalled_for: float, heartbeat_timeout: float,
                    stall_timeout: float) -> float:
    """Seconds a serving worker may go without a heartbeat before it counts as hung, given
    what its last heartbeat said (`blocking`, `stalled_for`). The supervisor (which kills) and
    the gateway (which stops routing and fails the worker's requests) apply the same rule.

    NOTE: a worker that says it is `blocking` is inside a pipeline call that holds the GIL
    (the llm role's ContinuousBatchingPipeline.step(): a long prompt's prefill took 5-13 s in
    one step on 2 CPU cores), so its heartbeat thread cannot run until the call returns. Its
    silence is then time without progress, judged by stall_timeout like any busy worker that
    makes none, instead of getting a healthy worker killed after heartbeat_timeout. The
    supervisor, which can read the worker's CPU time from the OS, shortens this to
    heartbeat_timeout for a silent worker that is not computing (stopped or deadlocked:
    supervisor/liveness.py) and tells the gateway (`UNRESPONSIVE`), which then fails the
    worker's requests and routes nothing more to it. Where it can read that CPU time, the
    callers pass `busy_limit` for `stall_timeout`: a worker silent in a step while computing
    (a prefill on a loaded machine took over 120 s) may take as long as a request may.
    """
    if blocking:
        return max(0.0, stall_timeout - stalled_for)
    return heartbeat_timeout


def observed(state: ProcessState, fresh: bool) -> ProcessState:
    """The state as seen by a peer that hears the worker itself (the gateway): a serving
    worker it has not heard from recently enough is unresponsive, whatever it last said."""
    return ProcessState.UNRESPONSIVE if state.serving and not fresh else state
