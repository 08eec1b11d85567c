"""The supervisor's set-up: the runtime folder, keys, the control and events sockets bound
(a second instance refused), the children built from the configuration, and the effective
configuration written for them."""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from npu_proxy.protocol import control
from npu_proxy.protocol.config import Config, WorkerSpec, dump_config
from npu_proxy.protocol.control import Ping, Pong
from npu_proxy.protocol.keys import KeysError, ensure_keys, load_keys, public_key, worker_clients
from npu_proxy.protocol.sockets import (
    TOPIC_HEARTBEAT,
    Endpoint,
    bind,
    configure_sub,
    connect,
    control_endpoint,
    events_endpoint,
    tcp_ports,
    worker_endpoint,
)
from npu_proxy.protocol.states import ProcessState
from npu_proxy.supervisor.children import Child
from npu_proxy.supervisor.logfiles import RotatingLog
from npu_proxy.supervisor.memory import machine_mib
from npu_proxy.supervisor.runtime_dir import prepare_runtime_dir

log = logging.getLogger(__name__)


def _nobody_listens(endpoint: Endpoint) -> bool:
    """True when the OS refuses a connection to `endpoint`: no socket file, or nothing
    listening on it (a stale file, a free port). False when something accepts or it cannot
    tell (then ask with a Ping)."""
    where: str | tuple[str, int]
    if endpoint.tcp:
        host, _, port = endpoint.address.removeprefix("tcp://").rpartition(":")
        family, where = socket.AF_INET, (host, int(port))
    else:
        unix = getattr(socket, "AF_UNIX", None)
        if unix is None:
            return False
        family, where = unix, endpoint.address.removeprefix("ipc://")
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.3)
        try:
            probe.connect(where)
        except (FileNotFoundError, ConnectionRefusedError):
            return True
        except OSError:
            return False
    return False


class CannotStart(Exception):
    """The instance cannot start as configured; the message says why."""


class AlreadyRunning(CannotStart):
    pass


def _taken(what: str) -> str:
    return (f"{what} is already in use: another npu-proxy instance (another runtime folder "
            "or user) or another program holds it. Stop it, or give this instance other "
            "ports (tcp_base_port) or another runtime_dir")


class SupervisorSetUp:
    """The supervisor's state and its set-up; the control handlers (commands.py) and the
    watch loop (loop.py) build on it."""

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
        self._status_seen: dict[str, tuple[ProcessState, int, int, str, bool]] = {}
        # The machine's memory, which a worker's default memory limit is a share of.
        self.machine_mib = machine_mib()

    # --- set-up --------------------------------------------------------------------------

    def _check_not_running(self) -> None:
        endpoint = control_endpoint(self.config)
        # NOTE: the usual case, no instance, is told at once by the OS; the Ping below waits
        # its whole timeout for an answer nobody sends (0.3 s of every start, bench/start.py).
        if _nobody_listens(endpoint):
            return
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

