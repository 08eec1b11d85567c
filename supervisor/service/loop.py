"""The supervisor's main loop: children, heartbeats, deadlines, restarts, control socket.

Every state change of a child is an event of protocol/states.py's table (`Child.apply`);
every control command (protocol/control.py) has one handler method (commands.py).
"""

from __future__ import annotations

import logging
import signal
import sys
import time

import msgspec
import zmq

from npu_proxy.protocol.config import speech_missing
from npu_proxy.protocol.liveness import Heartbeat, WorkerExited, WorkerStatus
from npu_proxy.protocol.messages import encode, reply_decoder
from npu_proxy.protocol.sockets import term
from npu_proxy.protocol.states import Event, ProcessState, reported
from npu_proxy.supervisor.children import Child
from npu_proxy.supervisor.memory import over_limit
from npu_proxy.supervisor.service.commands import ControlHandlers

log = logging.getLogger(__name__)


class Supervisor(ControlHandlers):
    # --- loop ----------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.setup()
        # NOTE: the gateway first: its imports are the path to /health/ready (bench/start.py),
        # a worker's load is waited for by its requests.
        if "gateway" in self.children:
            self.children["gateway"].spawn()
        for spec in self.config.local_workers():
            if spec.enabled and not spec.lazy:
                self.children[spec.name].spawn()
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        for sub in self.worker_subs:
            poller.register(sub, zmq.POLLIN)
        decoder = reply_decoder()
        while not self.stopping:
            try:
                ready = dict(poller.poll(50))
            except zmq.ZMQError:
                continue  # interrupted by a signal
            for sub, name in self.worker_subs.items():
                while sub in ready and sub.poll(0):
                    _topic, raw = sub.recv_multipart()
                    try:
                        beat = decoder.decode(raw)
                    except msgspec.DecodeError:
                        continue
                    if isinstance(beat, Heartbeat):
                        self._on_heartbeat(name, beat)
            if self.control in ready:
                self._serve_control()
            self._check_children()
            self._publish_status()
        self.shutdown()
        return 0

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.stopping:
            log.info("received %s: stopping", signal.Signals(signum).name)
        self.stopping = True

    def _on_heartbeat(self, name: str, beat: Heartbeat) -> None:
        child = self.children[name]
        if child.pid is None or beat.pid != child.pid:
            return  # a late frame from a previous incarnation
        child.heartbeat_at = time.monotonic()
        child.stalled_for = beat.stalled_for
        child.blocking = beat.blocking
        if beat.state == ProcessState.FAILED and beat.error:
            # NOTE: the worker exits next; its exit decides between backoff and failed.
            child.last_error = beat.error
        event = reported(beat.state)
        if event is not None:
            child.apply(event)
        self._announce()

    def _publish_status(self) -> None:
        """Tell the gateway each worker's supervised state: on change, and once a second."""
        now = time.monotonic()
        periodic = now - self._status_sent_at >= 1.0
        for child in self.children.values():
            if child.kind == "gateway":
                continue
            row = (child.state, child.pid or 0, child.restarts, child.last_error,
                   child.recovering)
            if periodic or self._status_seen.get(child.name) != row:
                self._status_seen[child.name] = row
                self.events.send(encode(WorkerStatus(
                    worker=child.name, state=child.state, pid=child.pid or 0,
                    restarts=child.restarts, last_error=child.last_error,
                    recovering=child.recovering)))
        if periodic:
            self._status_sent_at = now

    def _announce(self) -> None:
        if self.announced:
            return
        workers = [c for c in self.children.values() if c.kind != "gateway" and c.pid]
        if workers and all(c.state.serving for c in workers):
            self.announced = True
            names = ", ".join(c.name for c in workers)
            where = ("serving workers for other hosts' gateways (worker-only)"
                     if self.config.worker_only
                     else f"listening on http://{self.config.host}:{self.config.port}")
            print(f"npu-proxy {where} (workers: {names})", file=sys.stderr, flush=True)
            if not any(c.kind == "tts" for c in self.children.values()) and \
                    (missing := speech_missing()):
                log.warning("%s", missing)

    def _check_children(self) -> None:
        now = time.monotonic()
        for child in self.children.values():
            proc = child.proc
            if proc is not None and proc.returncode is None:
                code = proc.poll()
                if code is not None:
                    self._on_exit(child, code)
                elif child.kill_at and now > child.kill_at:
                    self._kill(child, "did not stop within the grace period")
                elif child.kind != "gateway":
                    self._check_deadlines(child, now)
            elif child.state == ProcessState.BACKOFF and now >= child.next_start:
                child.spawn()

    def _check_deadlines(self, child: Child, now: float) -> None:
        if child.state == ProcessState.UNRESPONSIVE:
            return  # NOTE: already killed; waiting for the exit
        spec = self.config.worker(child.name)
        reason = child.hang_reason(spec, now, self.config.inference_timeout) or \
            over_limit(spec, child.pid, self.machine_mib)
        if reason is not None:
            self._kill(child, reason, hung=True)

    def _kill(self, child: Child, reason: str, hung: bool = False) -> None:
        log.error("killing %s: %s", child.name, reason)
        if not child.expected_exit:
            child.last_error = reason
        if hung:
            child.apply(Event.HUNG)
        child.signal(signal.SIGKILL)

    def _on_exit(self, child: Child, code: int) -> None:
        pid = child.proc.pid if child.proc else 0
        if child.expected_exit:
            log.info("%s (pid %d) exited with code %d", child.name, pid, code)
        else:
            if not child.last_error or code != 0:
                child.last_error = child.last_error or f"exited with code {code}"
            log.error("%s (pid %d) exited unexpectedly with code %d", child.name, pid, code)
        child.kill_at = 0.0
        # NOTE: only the restart of a crash recovers; an exit held stopped or unloaded for
        # idleness ends any recovery, so the next start is a first load again.
        child.recovering = False
        if child.hold:
            child.apply(Event.EXIT_HELD)
        elif child.unloading:
            child.unloading = False
            child.apply(Event.EXIT_IDLE)
            self._go_home(child)
        else:
            self._schedule_restart(child, counted=not child.expected_exit)
        if child.kind != "gateway":
            # NOTE: the new state first, so that a gateway failing the worker's requests on
            # WorkerExited already sees it down (both on one socket: they arrive in order).
            self._publish_status()
            self.events.send(encode(WorkerExited(worker=child.name, pid=pid, returncode=code,
                                                 expected=child.expected_exit)))

    def _schedule_restart(self, child: Child, counted: bool) -> None:
        now = time.monotonic()
        delay = 0.0
        if counted:
            child.crash_times.append(now)
            while child.crash_times and now - child.crash_times[0] > self.config.restart_window:
                child.crash_times.popleft()
            limit = self.config.max_restarts
            if child.kind != "gateway":
                limit = self.config.worker(child.name).max_restarts or limit
            if len(child.crash_times) > limit:
                child.apply(Event.CRASH_LOOP)
                log.error("%s failed: %d crashes within %.0f s; not restarting until an "
                          "operator starts it (last error: %s)", child.name,
                          len(child.crash_times), self.config.restart_window, child.last_error)
                return
            delay = min(self.config.backoff_max,
                        self.config.backoff_initial * 2 ** (len(child.crash_times) - 1))
        child.restarts += 1
        child.recovering = counted
        child.apply(Event.EXIT)
        child.next_start = now + delay
        log.info("restarting %s in %.1f s", child.name, delay)

    def _go_home(self, child: Child) -> None:
        """An unloaded worker that served a switched-to model starts with its own next."""
        spec = self.config.worker(child.name)
        if spec.switched_from:
            self._set_spec(msgspec.structs.replace(spec, model=spec.switched_from,
                                                   switched_from=""))

    # --- shutdown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        running = [c for c in self.children.values() if c.pid is not None]
        for child in running:
            child.expected_exit = True
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace_period
        for child in running:
            assert child.proc is not None
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except Exception:
                log.warning("%s did not stop in time; killing it", child.name)
                child.signal(signal.SIGKILL)
                child.proc.wait(5)
        for sock in [self.control, self.events, *self.worker_subs]:
            sock.close(0)
        term(self.ctx)
        log.info("stopped")
