"""The control plane: commands to the supervisor and its replies, and the one client.

`npx-supervisor` (start/stop/restart/status, and rm's unloading), the gateway's model
switching and a second supervisor checking for a running one all talk to the supervisor's
REP socket through `call`. Each command and reply is a tagged msgspec Struct encoded as
MessagePack, decoded by one typed Decoder per direction, like the data plane
(protocol/messages.py). Commands name models, never paths.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
import zmq

from npu_proxy.protocol.config import Config
from npu_proxy.protocol.keys import KeysError
from npu_proxy.protocol.sockets import connect, control_endpoint, ipc_path_refusal
from npu_proxy.protocol.states import ProcessState

# --- commands (CLI, gateway -> supervisor) -----------------------------------------------


class Ping(msgspec.Struct, tag=True):
    """Is a supervisor running here? Answered with Pong."""


class Status(msgspec.Struct, tag=True):
    """Every process the supervisor runs. Answered with StatusReply."""


class Start(msgspec.Struct, tag=True):
    """Start a stopped, failed or idle (not loaded) worker (with its configuration as it is
    now); the gateway sends it for a lazy worker a request needs. A worker draining after
    Unload is started again once it has exited."""

    worker: str


class Stop(msgspec.Struct, tag=True):
    """Drain and stop a worker; it stays stopped until started."""

    worker: str


class Unload(msgspec.Struct, tag=True):
    """Stop a worker that idled past its keep_alive (the gateway decides): drained like Stop,
    but not held: it is `idle` (not loaded) until Start, and no crash (no restart, no
    backoff). A worker switched to another model goes back to its configured one."""

    worker: str


class Restart(msgspec.Struct, tag=True):
    """Restart a worker: drain its in-flight requests first, or kill it at once (`now`)."""

    worker: str
    now: bool = False


class Load(msgspec.Struct, tag=True):
    """Reload a worker with model `model` ("" = its configured one). Answered with Loaded."""

    worker: str
    model: str = ""


class Shutdown(msgspec.Struct, tag=True):
    """Stop every process and the supervisor."""


Command = Ping | Status | Start | Stop | Restart | Load | Shutdown | Unload


# --- replies (supervisor -> CLI, gateway) ------------------------------------------------


class Ok(msgspec.Struct, tag=True):
    """Done (or under way: a stop drains first)."""


class Refused(msgspec.Struct, tag=True):
    """The command was not carried out, and why."""

    error: str


class Pong(msgspec.Struct, tag=True):
    pid: int


class ChildStatus(msgspec.Struct):
    """One row of `npx-supervisor status`."""

    name: str
    # "gateway" or the worker's role.
    role: str
    device: str
    model: str
    state: ProcessState
    pid: int | None
    uptime: float
    restarts: int
    last_error: str
    # The process replaces one that crashed (protocol/liveness.py WorkerStatus.recovering).
    recovering: bool = False

    def as_json(self) -> dict[str, object]:
        """The row as `status --json` shows it: the state by its label."""
        return {f: getattr(self, f) for f in self.__struct_fields__} | {
            "state": self.state.label}


class StatusReply(msgspec.Struct, tag=True):
    pid: int
    host: str
    port: int
    children: list[ChildStatus]


class Loaded(msgspec.Struct, tag=True):
    """The worker runs (or is restarting with) `model`; `changed` if it had to switch."""

    model: str
    changed: bool


Reply = Ok | Refused | Pong | StatusReply | Loaded


# --- codec -------------------------------------------------------------------------------


def encode(msg: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(msg)


def command_decoder() -> msgspec.msgpack.Decoder[Command]:
    return msgspec.msgpack.Decoder(Command)


def reply_decoder() -> msgspec.msgpack.Decoder[Reply]:
    return msgspec.msgpack.Decoder(Reply)


# --- the client --------------------------------------------------------------------------


class ControlError(Exception):
    """A command did not get the reply it asked for."""


class NoSupervisor(ControlError):
    """No supervisor answered on the control socket in time."""


class CommandRefused(ControlError):
    """The supervisor answered Refused; the message is its reason."""


R = TypeVar("R", bound=msgspec.Struct)


def call(config: Config, command: Command, expect: type[R], timeout: float = 30.0) -> R:
    """Send `command` to the supervisor of `config` and return its reply, which must be an
    `expect`.

    Blocking; the gateway runs it in a thread (asyncio.to_thread). Raises NoSupervisor when
    nothing answers within `timeout` seconds (on tcp also when the instance's keys are
    missing, or the socket's owner cannot prove it holds them), CommandRefused on Refused.
    """
    if (refusal := ipc_path_refusal(config)) is not None:
        raise NoSupervisor(refusal)  # NOTE: none can run there (ZeroMQ: "File name too long")
    endpoint = control_endpoint(config)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        try:
            connect(sock, config, endpoint)
        except KeysError as exc:
            raise NoSupervisor(f"no npu-proxy instance at {endpoint}: {exc}") from exc
        sock.send(encode(command))
        if not sock.poll(int(timeout * 1000)):
            raise NoSupervisor(f"no npu-proxy instance answers at {endpoint}")
        raw = sock.recv()
    finally:
        sock.close(0)
    try:
        reply = reply_decoder().decode(raw)
    except msgspec.DecodeError as exc:
        raise ControlError(f"undecodable reply from {endpoint}: {exc}") from exc
    if isinstance(reply, Refused):
        raise CommandRefused(reply.error)
    if not isinstance(reply, expect):
        raise ControlError(f"{type(command).__name__} was answered with "
                           f"{type(reply).__name__}, not {expect.__name__}")
    return reply
