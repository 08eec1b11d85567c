"""The supervisor's main loop: children, heartbeats, deadlines, restarts, control socket.

Every state change of a child is an event of protocol/states.py's table (`Child.apply`);
every control command (protocol/control.py) has one handler method here.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from npu_proxy.models.locate import locate
from npu_proxy.models.registry import ModelSourceMissing
from npu_proxy.protocol import control
from npu_proxy.protocol.config import Config, ConfigError, WorkerSpec, dump_config
from npu_proxy.protocol.control import (
    ChildStatus,
    Command,
    Load,
    Loaded,
    Ok,
    Ping,
    Pong,
    Refused,
    Reply,
    Restart,
    Shutdown,
    Start,
    Status,
    StatusReply,
    Stop,
    Unload,
)
from npu_proxy.protocol.keys import KeysError, ensure_keys, load_keys, public_key, worker_clients
from npu_proxy.protocol.messages import (
    Heartbeat,
    WorkerExited,
    WorkerState,
    WorkerStatus,
    encode,
    reply_decoder,
)
from npu_proxy.protocol.sockets import (
    TOPIC_HEARTBEAT,
    Endpoint,
    bind,
    configure_sub,
    connect,
    control_endpoint,
    events_endpoint,
    tcp_ports,
    term,
    worker_endpoint,
)
from npu_proxy.protocol.states import Event, ProcessState, reported
from npu_proxy.supervisor.children import Child
from npu_proxy.supervisor.logfiles import RotatingLog
from npu_proxy.supervisor.runtime_dir import prepare_runtime_dir

log = logging.getLogger(__name__)


class CannotStart(Exception):
    """The instance cannot start as configured; the message says why."""


class AlreadyRunning(CannotStart):
    pass


class Refusal(Exception):
    """A control command that cannot be carried out; its message goes back as Refused."""


def _taken(what: str) -> str:
    return (f"{what} is already in use: another npu-proxy instance (another runtime folder "
            "or user) or another program holds it. Stop it, or give this instance other "
            "ports (tcp_base_port) or another runtime_dir")


class Supervisor:
    def __init__(self, config: Config, echo: bool = True,
                 reload: Callable[[], Config] | None = None) -> None:
        self.config = config
        self.reload = reload
        self.runtime = config.runtime_path()
        self.echo = echo
        self.ctx = zmq.Context()
        self.children: dict[str, Child] = {}
        self.worker_subs: dict[zmq.Socket, str] = {}  # type: ignore[type-arg]
        self.stopping = False
        self.announced = False
        self._status_sent_at = 0.0
        self._status_seen: dict[str, tuple[ProcessState, int, int, str]] = {}
        self._commands = control.command_decoder()
        # NOTE: one handler per command type; a new command is a Struct and an entry here.
        self._handlers: dict[type[Command], Callable[[Any], Reply]] = {
            Ping: self._ping,
            Status: self._status,
            Shutdown: self._shutdown,
            Start: self._start,
            Stop: self._stop,
            Restart: self._restart,
            Load: self._load,
            Unload: self._unload,
        }

    # --- set-up --------------------------------------------------------------------------

    def _check_not_running(self) -> None:
        try:
            control.call(self.config, Ping(), Pong, timeout=0.3)
        except control.NoSupervisor:
            return
        except control.ControlError:
            pass  # NOTE: something answers there, even if not as this version would
        raise AlreadyRunning(f"an npu-proxy instance already runs in {self.runtime}")

    def _bind_or_refuse(self, sock: zmq.Socket[Any], endpoint: Endpoint) -> None:
        try:
            bind(sock, self.config, endpoint)
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise AlreadyRunning(_taken(str(endpoint))) from exc

    def _check_worker_ports(self) -> None:
        """tcp: each worker port must be free before any worker starts (the control port,
        bound first and held, is what keeps a second instance out)."""
        for host, port, what in tcp_ports(self.config)[2:]:
            with socket.socket() as probe:
                if os.name == "posix":
                    # NOTE: as ZeroMQ binds: a port with only closed connections is free.
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((host, port))
                except OSError as exc:
                    raise AlreadyRunning(_taken(f"tcp://{host}:{port} ({what})")) from exc

    def _log(self, name: str) -> RotatingLog:
        return RotatingLog(self.runtime / "logs" / f"{name}.log", self.config.log_max_bytes,
                           self.config.log_backups)

    def setup(self) -> None:
        prepare_runtime_dir(self.runtime)
        if self.config.worker_only and self.config.transport != "tcp":
            raise CannotStart("--worker-only serves other hosts over tcp: set transport = "
                              "\"tcp\" and worker_host to this host's address")
        if self.config.transport == "tcp" or any(w.address for w in self.config.workers):
            try:
                ensure_keys(self.config)
                for spec in self.config.workers:
                    if spec.address:
                        public_key(spec.public_key_file)
                worker_clients(self.config, load_keys(self.config))
            except KeysError as exc:
                raise CannotStart(str(exc)) from exc
        self._check_not_running()
        # NOTE: the control socket first: while it is bound no second instance can start
        # on these ports (tcp) or in this folder (ipc).
        self.control = self.ctx.socket(zmq.REP)
        self.control.setsockopt(zmq.LINGER, 0)
        self.events = self.ctx.socket(zmq.PUB)
        self.events.setsockopt(zmq.LINGER, 0)
        self._bind_or_refuse(self.control, control_endpoint(self.config))
        self._bind_or_refuse(self.events, events_endpoint(self.config))
        self._check_worker_ports()
        config_path = self.config_path = self.runtime / "config.json"
        workers_path = self.workers_config_path = self.runtime / "workers.json"
        self._write_configs()
        python = sys.executable
        if not self.config.worker_only:
            self.children["gateway"] = Child(
                "gateway", "gateway",
                [python, "-m", "npu_proxy.gateway", "--config", str(config_path)],
                self._log("gateway"), self.echo)
        for spec in self.config.local_workers():
            child = Child(spec.name, spec.role,
                          [python, "-m", "npu_proxy.workers", "--config", str(workers_path),
                           "--worker", spec.name],
                          self._log(spec.name), self.echo)
            child.model = spec.model_name
            child.device = spec.device
            if spec.enabled and spec.lazy:
                # NOTE: not loaded until a request needs it; the gateway then starts it.
                child.state = ProcessState.IDLE
            self.children[spec.name] = child
            sub = self.ctx.socket(zmq.SUB)
            configure_sub(sub, TOPIC_HEARTBEAT)
            connect(sub, self.config, worker_endpoint(self.config, spec.name, "out"))
            self.worker_subs[sub] = spec.name
            if self.config.worker_only:
                log.info("worker %s serves at %s (in) and %s (out)", spec.name,
                         worker_endpoint(self.config, spec.name, "in"),
                         worker_endpoint(self.config, spec.name, "out"))

    # --- loop ----------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.setup()
        for spec in self.config.local_workers():
            if spec.enabled and not spec.lazy:
                self.children[spec.name].spawn()
        if "gateway" in self.children:
            self.children["gateway"].spawn()
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
        if beat.state == WorkerState.FAILED and beat.error:
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
            row = (child.state, child.pid or 0, child.restarts, child.last_error)
            if periodic or self._status_seen.get(child.name) != row:
                self._status_seen[child.name] = row
                self.events.send(encode(WorkerStatus(
                    worker=child.name, state=child.state, pid=child.pid or 0,
                    restarts=child.restarts, last_error=child.last_error)))
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
        reason = child.hang_reason(self.config.worker(child.name), now)
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
            self.events.send(encode(WorkerExited(worker=child.name, pid=pid, returncode=code)))

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
        child.apply(Event.EXIT)
        child.next_start = now + delay
        log.info("restarting %s in %.1f s", child.name, delay)

    # --- control socket ------------------------------------------------------------------

    def _serve_control(self) -> None:
        raw = self.control.recv()
        reply: Reply
        try:
            command = self._commands.decode(raw)
            reply = self._handlers[type(command)](command)
        except msgspec.DecodeError as exc:
            reply = Refused(error=f"not a control command: {exc}")
        except Refusal as exc:
            reply = Refused(error=str(exc))
        except Exception as exc:
            log.exception("control command failed")
            reply = Refused(error=str(exc))
        self.control.send(control.encode(reply))

    def status(self) -> list[ChildStatus]:
        return [ChildStatus(name=child.name, role=child.kind, device=child.device,
                            model=child.model, state=child.state, pid=child.pid,
                            uptime=round(child.uptime(), 1), restarts=child.restarts,
                            last_error=child.last_error)
                for child in self.children.values()]

    def _child(self, name: str) -> Child:
        child = self.children.get(name)
        if child is None:
            raise Refusal(f"no worker named {name!r}")
        return child

    def _ping(self, command: Ping) -> Reply:
        return Pong(pid=os.getpid())

    def _status(self, command: Status) -> Reply:
        return StatusReply(pid=os.getpid(), host=self.config.host, port=self.config.port,
                           children=self.status())

    def _shutdown(self, command: Shutdown) -> Reply:
        self.stopping = True
        return Ok()

    def _stop(self, command: Stop) -> Reply:
        child = self._child(command.worker)
        child.hold = True
        if child.pid is None:
            child.apply(Event.STOP)
        else:
            self._terminate(child)
        return Ok()

    def _release(self, name: str) -> Child:
        """The named child with an operator's hold lifted and its configuration as it is
        now; spawned at once (a fresh crash count) when no process runs. One being unloaded
        is started again once it has exited."""
        child = self._child(name)
        if child.kind != "gateway":
            self._reload_spec(child.name)
        child.hold = False
        child.unloading = False
        if child.pid is None:
            child.crash_times.clear()
            child.spawn()
        return child

    def _start(self, command: Start) -> Reply:
        child = self._child(command.worker)
        if child.pid is None:
            child.last_error = ""
        self._release(command.worker)
        return Ok()

    def _restart(self, command: Restart) -> Reply:
        running = self._child(command.worker).pid is not None
        child = self._release(command.worker)
        if running and command.now:
            # NOTE: no state of its own: SIGKILL cannot be ignored, the exit follows at once.
            child.expected_exit = True
            child.signal(signal.SIGKILL)
        elif running:
            self._terminate(child)
        return Ok()

    def _reload_spec(self, name: str) -> None:
        """Take a worker's section from the configuration as it is now (a fixed file)."""
        if self.reload is None:
            return
        try:
            spec = self.reload().worker(name)
        except (ConfigError, KeyError) as exc:
            log.warning("keeping the running configuration of %s: %s", name, exc)
            return
        if spec == self.config.worker(name):
            return
        log.info("worker %s: configuration changed; the next start uses it", spec.name)
        self._set_spec(spec)

    def _write_configs(self) -> None:
        """The effective configuration for the children (0600): the gateway's whole, the
        workers' without the API key, which only the gateway checks."""
        for path, config in ((self.config_path, self.config),
                             (self.workers_config_path,
                              msgspec.structs.replace(self.config, api_key=""))):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(dump_config(config))
            os.chmod(path, 0o600)

    def _set_spec(self, spec: WorkerSpec) -> None:
        workers = [spec if w.name == spec.name else w for w in self.config.workers]
        self.config = msgspec.structs.replace(self.config, workers=workers)
        self._write_configs()
        child = self.children[spec.name]
        child.model = spec.model_name
        child.device = spec.device

    def _load(self, command: Load) -> Reply:
        """Reload a worker with another model ("" = back to its configured one): the
        gateway asks when a request names a model no worker runs, or when keep_alive ends."""
        child = self._child(command.worker)
        if child.kind == "gateway":
            raise Refusal("the gateway runs no model")
        spec = self.config.worker(child.name)
        if not spec.allow_switch:
            raise Refusal(f"worker {child.name} does not switch models (allow_switch = false)")
        home = spec.switched_from or spec.model_name
        target = command.model or home
        self._check_model(target)
        changed = target != spec.model_name
        if changed:
            log.info("worker %s: switching model %s -> %s", child.name, spec.model_name, target)
            self._set_spec(msgspec.structs.replace(
                spec, model=target, switched_from="" if target == home else home))
        child.hold = False
        child.unloading = False
        if child.pid is None:
            child.crash_times.clear()
            child.last_error = ""
            child.spawn()
        elif changed:
            self._terminate(child)  # NOTE: drains; the exit handler restarts it at once
        return Loaded(model=target, changed=changed)

    def _unload(self, command: Unload) -> Reply:
        """Stop a worker the gateway found idle past its keep_alive: drained, then `idle`."""
        child = self._child(command.worker)
        if child.kind == "gateway":
            raise Refusal("the gateway is not unloaded")
        if child.pid is None or child.hold:
            return Ok()  # NOTE: already not running, or an operator's stop is under way
        log.info("unloading %s: idle past its keep_alive", child.name)
        child.unloading = True
        self._terminate(child)
        return Ok()

    def _go_home(self, child: Child) -> None:
        """An unloaded worker that served a switched-to model starts with its own next."""
        spec = self.config.worker(child.name)
        if spec.switched_from:
            self._set_spec(msgspec.structs.replace(spec, model=spec.switched_from,
                                                   switched_from=""))

    def _check_model(self, name: str) -> None:
        """A model named over the control socket: one of the configuration's own, or a name
        the registry resolves to files (pulled, configured, embedded), never a path."""
        if name in {w.model_name for w in self.config.workers}:
            return
        try:
            locate(self.config, name, allow_path=False)
        except ModelSourceMissing as exc:
            raise Refusal(f"cannot load {name!r}: {exc}") from exc

    def _terminate(self, child: Child) -> None:
        """SIGTERM now (the worker drains), SIGKILL once the grace period has passed."""
        child.expected_exit = True
        child.kill_at = time.monotonic() + self.config.grace_period
        child.apply(Event.TERMINATE)
        child.signal(signal.SIGTERM)

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
