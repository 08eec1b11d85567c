"""One state vocabulary: the transition table itself and the gateway's view of a worker."""

from __future__ import annotations

import time

from gateway.core.broker import WorkerLink
from protocol.config import WorkerSpec
from protocol.messages import Heartbeat, WorkerState, WorkerStatus
from protocol.states import TRANSITIONS, Event, ProcessState, observed, reported, transition

S = ProcessState

# --- the table ---------------------------------------------------------------------------


def test_wire_numbering_is_kept() -> None:
    """Heartbeats carry the state as a number: the old numbers mean what they meant."""
    assert WorkerState is ProcessState
    old = ["starting", "loading", "warming", "ready", "busy", "draining", "stopped", "failed"]
    assert [ProcessState(i).label for i in range(len(old))] == old
    assert len({s.label for s in ProcessState}) == len(ProcessState)


def test_life_cycle_through_the_table() -> None:
    state = S.STOPPED
    steps = [
        (Event.SPAWN, S.STARTING), (Event.REPORT_LOADING, S.LOADING),
        (Event.REPORT_WARMING, S.WARMING), (Event.REPORT_READY, S.READY),
        (Event.REPORT_BUSY, S.BUSY), (Event.REPORT_READY, S.READY),
        (Event.EXIT, S.BACKOFF), (Event.SPAWN, S.STARTING), (Event.REPORT_READY, S.READY),
        (Event.TERMINATE, S.DRAINING), (Event.REPORT_READY, S.DRAINING),
        (Event.EXIT_HELD, S.STOPPED), (Event.SPAWN, S.STARTING),
        (Event.HUNG, S.UNRESPONSIVE), (Event.REPORT_READY, S.UNRESPONSIVE),
        (Event.CRASH_LOOP, S.FAILED), (Event.REPORT_READY, S.FAILED),
        (Event.STOP, S.STOPPED), (Event.SPAWN_SILENT, S.RUNNING),
    ]
    for event, expected in steps:
        state = transition(state, event)
        assert state == expected, (event, state)


def test_every_event_in_every_state_has_an_answer() -> None:
    for event in Event:
        for state in ProcessState:
            after = transition(state, event)
            assert isinstance(after, ProcessState)
            # A process exists before and after, or the event is what starts or ends it.
            if event in (Event.SPAWN, Event.SPAWN_SILENT):
                assert after.alive or after == state
            elif event in (Event.EXIT, Event.EXIT_HELD, Event.CRASH_LOOP, Event.STOP):
                assert not after.alive or after == state
            else:
                assert after.alive == state.alive, (event, state, after)
    # Nothing the worker reports overrides the supervisor's own decisions.
    for state in (S.DRAINING, S.UNRESPONSIVE, S.BACKOFF, S.STOPPED, S.FAILED):
        for reported_state in ProcessState:
            event = reported(reported_state)
            if event is not None:
                assert transition(state, event) == state
    assert all(target != S.FAILED for (event, _), target in TRANSITIONS.items()
               if event != Event.CRASH_LOOP)


def test_observed_state() -> None:
    assert observed(S.READY, fresh=False) == S.UNRESPONSIVE
    assert observed(S.BUSY, fresh=True) == S.BUSY
    assert observed(S.LOADING, fresh=False) == S.LOADING  # a compile may silence heartbeats


def _link(supervised: WorkerStatus | None, beat: Heartbeat | None,
          beat_age: float = 0.0) -> WorkerLink:
    link = WorkerLink(spec=WorkerSpec(name="w", heartbeat_timeout=10.0, stall_timeout=60.0),
                      push=None, sub=None)  # type: ignore[arg-type]
    link.supervised = supervised
    link.heartbeat = beat
    link.seen_at = time.monotonic() - beat_age if beat is not None else 0.0
    return link


def _beat(pid: int, state: ProcessState, stalled_for: float = 0.0) -> Heartbeat:
    return Heartbeat(worker="w", pid=pid, role="llm", device="CPU", model="m", state=state,
                     stalled_for=stalled_for)


def test_the_gateway_reads_the_supervisors_state_and_its_own_freshness() -> None:
    ready = WorkerStatus(worker="w", state=S.READY, pid=7)
    assert _link(ready, _beat(7, S.READY)).state == S.READY
    assert _link(ready, _beat(7, S.READY)).serving
    # The supervisor's decision wins over the last heartbeat ...
    assert _link(WorkerStatus(worker="w", state=S.BACKOFF), _beat(7, S.READY)).state == S.BACKOFF
    assert _link(WorkerStatus(worker="w", state=S.DRAINING, pid=7),
                 _beat(7, S.READY)).state == S.DRAINING
    # ... but a serving worker the gateway no longer hears, or that makes no progress, is not.
    assert _link(ready, _beat(7, S.READY), beat_age=30.0).state == S.UNRESPONSIVE
    assert _link(ready, _beat(7, S.BUSY, stalled_for=90.0)).state == S.UNRESPONSIVE
    # A new process the gateway has not heard yet: its state, but no requests until it has.
    fresh = _link(ready, _beat(6, S.READY))
    assert fresh.state == S.READY and not fresh.serving
    # Before the supervisor's first status: the heartbeat, through the same table.
    assert _link(None, _beat(7, S.LOADING)).state == S.LOADING
    assert _link(None, _beat(7, S.FAILED)).state == S.STARTING
    assert _link(None, None).state == S.STARTING
