"""The supervisor's control socket: one handler per control command (protocol/control.py)."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import msgspec

from npu_proxy.protocol import control
from npu_proxy.protocol.config import Config, ConfigError
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
from npu_proxy.protocol.states import Event
from npu_proxy.supervisor.children import Child
from npu_proxy.supervisor.service.startup import SupervisorSetUp

log = logging.getLogger(__name__)


class Refusal(Exception):
    """A control command that cannot be carried out; its message goes back as Refused."""


class ControlHandlers(SupervisorSetUp):
    def __init__(self, config: Config, echo: bool = True,
                 reload: Callable[[], Config] | None = None) -> None:
        super().__init__(config, echo, reload)
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
                            last_error=child.last_error, recovering=child.recovering)
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
            child.recovering = False  # NOTE: a start, even of a worker waiting to restart
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
            child.recovering = False
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

    def _check_model(self, name: str) -> None:
        """A model named over the control socket: one of the configuration's own, or a name
        the registry resolves to files (pulled, configured, embedded), never a path."""
        if name in {w.model_name for w in self.config.workers}:
            return
        # NOTE: imported on use: the model registry is not on the supervisor's path to
        # spawning the gateway (bench/start.py).
        from npu_proxy.models.locate import locate
        from npu_proxy.models.registry import ModelSourceMissing

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

