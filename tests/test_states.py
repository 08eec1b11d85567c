"""One state vocabulary: the transition table itself, the gateway's view of a worker, and a
real worker walked through its life cycle while /metrics, /health/devices and
`npx-supervisor status --json` are read side by side and must name the same state."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serverctl import Server, small_llm

from npu_proxy.gateway.core.worker_link import WorkerLink
from npu_proxy.protocol.config import WorkerSpec
from npu_proxy.protocol.liveness import Heartbeat, WorkerStatus
from npu_proxy.protocol.states import (
    TRANSITIONS,
    Event,
    ProcessState,
    observed,
    reported,
    silence_allowed,
    transition,
)

S = ProcessState

# --- the table ---------------------------------------------------------------------------


def test_wire_numbering_is_kept() -> None:
    """Heartbeats carry the state as a number: the old numbers mean what they meant."""
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
            elif event in (Event.EXIT, Event.EXIT_HELD, Event.EXIT_IDLE, Event.CRASH_LOOP,
                           Event.STOP):
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


def _beat(pid: int, state: ProcessState, stalled_for: float = 0.0,
          blocking: bool = False) -> Heartbeat:
    return Heartbeat(worker="w", pid=pid, role="llm", device="CPU", model="m", state=state,
                     stalled_for=stalled_for, blocking=blocking)


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
    # Heard, but its last heartbeat still said loading: the supervisor's "ready" (from a
    # later heartbeat, on another socket) is not enough until the gateway hears it too.
    heard_loading = _link(ready, _beat(7, S.LOADING))
    assert heard_loading.state == S.READY and not heard_loading.serving
    # Before the supervisor's first status: the heartbeat, through the same table.
    assert _link(None, _beat(7, S.LOADING)).state == S.LOADING
    assert _link(None, _beat(7, S.FAILED)).state == S.STARTING
    assert _link(None, None).state == S.STARTING


def test_a_worker_blocking_in_a_step_is_judged_by_progress() -> None:
    """A worker inside a pipeline step that holds the GIL cannot heartbeat: its silence is
    time without progress (stall_timeout 60 here), not a lost heartbeat (10)."""
    ready = WorkerStatus(worker="w", state=S.BUSY, pid=7)
    assert _link(ready, _beat(7, S.BUSY, blocking=True), beat_age=30.0).state == S.BUSY
    assert _link(ready, _beat(7, S.BUSY, blocking=True), beat_age=30.0).serving
    assert _link(ready, _beat(7, S.BUSY, stalled_for=20.0, blocking=True),
                 beat_age=30.0).state == S.BUSY
    # Silence and the stall it reported add up past stall_timeout: hung.
    assert _link(ready, _beat(7, S.BUSY, stalled_for=40.0, blocking=True),
                 beat_age=30.0).state == S.UNRESPONSIVE
    assert _link(ready, _beat(7, S.BUSY, blocking=True), beat_age=61.0).state == S.UNRESPONSIVE
    # Not blocking: the heartbeat timeout, as before.
    assert _link(ready, _beat(7, S.BUSY), beat_age=30.0).state == S.UNRESPONSIVE
    assert silence_allowed(False, 0.0, 10.0, 60.0) == 10.0
    assert silence_allowed(True, 15.0, 10.0, 60.0) == 45.0
    assert silence_allowed(True, 90.0, 10.0, 60.0) == 0.0


# --- a real worker, three surfaces ---------------------------------------------------------


def _from_metrics(srv: Server, worker: str) -> str:
    r = httpx.get(srv.url + "/metrics", timeout=10)
    r.raise_for_status()
    states = [s.labels["state"]
              for family in text_string_to_metric_families(r.text)
              for s in family.samples
              if s.name == "npu_proxy_worker_state" and s.labels["worker"] == worker
              and s.value == 1]
    assert len(states) == 1, states
    return states[0]


def _from_health(srv: Server, worker: str) -> str:
    r = httpx.get(srv.url + "/health/devices", timeout=10)
    r.raise_for_status()
    return str(next(w["state"] for w in r.json()["workers"] if w["name"] == worker))


def _from_status(srv: Server, worker: str) -> dict[str, Any]:
    out = srv.cli("status", "--json").stdout
    reply = json.loads(out)
    assert reply["ok"] is True
    row: dict[str, Any] = next(c for c in reply["children"] if c["name"] == worker)
    return row


def _all_say(srv: Server, worker: str, state: str, timeout: float = 240.0) -> dict[str, Any]:
    """Poll until /metrics, /health/devices and `status --json` all name `state`; returns
    the status row. The three are read one after the other, so while the worker changes
    state they may differ for a moment; they must agree once it has settled."""
    deadline = time.monotonic() + timeout
    seen: tuple[str, str, str] = ("", "", "")
    while time.monotonic() < deadline:
        row = _from_status(srv, worker)
        seen = (_from_metrics(srv, worker), _from_health(srv, worker), row["state"])
        if seen == (state, state, state):
            return row
        time.sleep(0.2)
    raise AssertionError(f"{worker}: expected {state} everywhere, last saw (metrics, health, "
                         f"status) = {seen}\n{srv.logs()}")


def _still_all_say(srv: Server, worker: str, state: str) -> None:
    """In a state that only the test ends, every further reading agrees."""
    for _ in range(3):
        row = _from_status(srv, worker)
        assert (_from_metrics(srv, worker), _from_health(srv, worker), row["state"]) == (
            state, state, state)


@pytest.mark.timeout(900)
def test_one_worker_through_its_life_cycle(tmp_path: Path) -> None:
    gate = tmp_path / "load-may-finish"
    # NOTE: every state the test checks lasts until the test ends it: loading until the
    # gate file exists, backoff for ten minutes unless started by hand, stopped until
    # started. Nothing depends on how fast this machine is. The small model
    # (serverctl.small_llm): two loads, no request.
    srv = Server(tmp_path, workers=[
        {"name": "llm", "role": "llm", "load_timeout": 1800.0,
         "faults": {"hold_load_until": str(gate)}},
    ], backoff_initial=600.0, backoff_max=600.0, models=small_llm())
    srv.start(wait=False)
    try:
        srv.wait_http(120)
        _all_say(srv, "llm", "loading")
        _still_all_say(srv, "llm", "loading")

        gate.touch()
        first = _all_say(srv, "llm", "ready")
        assert first["pid"]

        os.kill(first["pid"], signal.SIGKILL)
        down = _all_say(srv, "llm", "backoff")
        assert down["pid"] is None and down["restarts"] == first["restarts"] + 1
        _still_all_say(srv, "llm", "backoff")

        # An operator does not wait out the backoff.
        assert "started llm" in srv.cli("start", "llm").stdout
        second = _all_say(srv, "llm", "ready")
        assert second["pid"] not in (None, first["pid"])

        assert "stopping llm" in srv.cli("stop", "llm").stdout
        stopped = _all_say(srv, "llm", "stopped")
        assert stopped["pid"] is None
        _still_all_say(srv, "llm", "stopped")
    finally:
        assert srv.stop() == set()


def test_the_gateway_waits_for_a_step_as_long_as_a_request_may() -> None:
    """A worker silent inside one step past stall_timeout still counts as serving while
    within the request limit (busy_limit): the supervisor says sooner if it is hung."""
    link = _link(WorkerStatus(worker="w", state=S.BUSY, pid=7),
                 _beat(7, S.BUSY, blocking=True), beat_age=90.0)
    assert link.state == S.UNRESPONSIVE  # stall_timeout 60, no request limit given
    link.busy_limit = 600.0
    assert link.state == S.BUSY
    link.seen_at -= 600.0
    assert link.state == S.UNRESPONSIVE
