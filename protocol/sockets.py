"""ZeroMQ endpoints, socket options and security, in one place for every process.

Each worker binds `<name>.in` (PULL: requests, aborts) and `<name>.out` (XPUB: everything it
says, each gateway's replies on that gateway's own topic: protocol/replies.py). The gateway
connects a PUSH to each `.in` and a SUB to each `.out`; the supervisor subscribes to every
`.out` for heartbeats and serves the control socket and its events.

Every socket binds through `bind` and connects through `connect`, the one code path for
security and size limits:
- ipc: endpoints in the private runtime folder (0700); no keys needed.
- tcp: CURVE (protocol/keys.py). Every bound socket is a CURVE server with this instance's
  server key, and a ZAP handler in its process accepts only known client keys; every
  connected socket logs in with this instance's client key and checks the server's key. A
  socket without the keys completes no handshake: it receives nothing and delivers nothing.
- every receiving socket has a message size cap (MAXMSGSIZE; a larger message drops the
  connection): a worker's requests by `max_body_bytes`, frames from workers by
  `max_frame_bytes`, control commands by CONTROL_MAX_BYTES.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import zmq

from npu_proxy.protocol.config import Config
from npu_proxy.protocol.keys import Keys, load_keys, public_key, worker_clients

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

# NOTE: PUB drops at the high-water mark. A worker emits at most a few frames per request per
# decode step; 100k frames is far beyond any burst a single device produces.
PUB_HWM = 100_000

# NOTE: the first frame of every PUB message is a topic, so the supervisor can subscribe to
# heartbeats alone and never decode token frames; a request's frames go on the topic of the
# gateway that sent it (`reply_topic`).
TOPIC_HEARTBEAT = b"h"
TOPIC_REQUEST = b"r"
# NOTE: what a worker's XPUB takes in is subscriptions: a topic of a few dozen bytes.
SUBSCRIPTION_MAX_BYTES = 1024

# NOTE: a control command names a worker and a model: a few hundred bytes.
CONTROL_MAX_BYTES = 64 * 1024
# NOTE: a request is the translation of one HTTP body (at most max_body_bytes); rendering
# tools into the prompt and msgpack framing add to it, never doubling it.
REQUEST_MARGIN = 1024 * 1024

# ZAP domains: who may connect to a bound socket. "local": this instance's own client key
# (control, events); "workers": also the gateways of other hosts (`client_key_files`).
Domain = Literal["local", "workers"]


@dataclass(frozen=True)
class Endpoint:
    """Where a socket binds or connects, and (tcp) who is on the other side."""

    address: str
    domain: Domain = "local"
    # tcp: the public key file of the binding side; "" = this instance's own server key.
    server_key_file: str = ""

    def __str__(self) -> str:
        return self.address

    @property
    def tcp(self) -> bool:
        return self.address.startswith("tcp://")


def _tcp_port(config: Config, index: int) -> int:
    return config.tcp_base_port + index


def _remote(address: str, offset: int) -> str:
    host, _, port = address.rpartition(":")
    return f"tcp://{host}:{int(port) + offset}"


def worker_endpoint(config: Config, worker: str, direction: Literal["in", "out"]) -> Endpoint:
    spec = config.worker(worker)
    offset = 0 if direction == "in" else 1
    if spec.address:
        return Endpoint(_remote(spec.address, offset), "workers", spec.public_key_file)
    if config.transport == "tcp":
        names = [w.name for w in config.local_workers()]
        port = _tcp_port(config, 2 + 2 * names.index(worker) + offset)
        return Endpoint(f"tcp://{config.worker_host}:{port}", "workers")
    return Endpoint(f"ipc://{config.runtime_path() / f'{worker}.{direction}'}", "workers")


def control_endpoint(config: Config) -> Endpoint:
    if config.transport == "tcp":
        return Endpoint(f"tcp://127.0.0.1:{_tcp_port(config, 0)}")
    return Endpoint(f"ipc://{config.runtime_path() / 'control'}")


def events_endpoint(config: Config) -> Endpoint:
    """The supervisor's PUB socket: worker exits and state changes, for the gateway."""
    if config.transport == "tcp":
        return Endpoint(f"tcp://127.0.0.1:{_tcp_port(config, 1)}")
    return Endpoint(f"ipc://{config.runtime_path() / 'events'}")


def tcp_ports(config: Config) -> list[tuple[str, int, str]]:
    """Every tcp (host, port, what for) this instance binds; none on ipc."""
    if config.transport != "tcp":
        return []
    ports = [("127.0.0.1", _tcp_port(config, 0), "control"),
             ("127.0.0.1", _tcp_port(config, 1), "events")]
    for index, spec in enumerate(config.local_workers()):
        for offset, direction in ((0, "in"), (1, "out")):
            ports.append((config.worker_host, _tcp_port(config, 2 + 2 * index + offset),
                          f"worker {spec.name} {direction}"))
    return ports


# The longest path a Unix socket may have: sun_path holds 108 bytes on Linux (104 on macOS
# and the BSDs), its terminating NUL included.
IPC_PATH_MAX = 107 if sys.platform.startswith("linux") else 103


def longest_ipc_path(config: Config) -> str | None:
    """The longest path of this instance's ipc sockets (control, events, each local worker's),
    or None on tcp."""
    if config.transport == "tcp":
        return None
    paths = [str(e)[len("ipc://"):] for e in (control_endpoint(config), events_endpoint(config))]
    paths += [str(worker_endpoint(config, spec.name, "out"))[len("ipc://"):]
              for spec in config.local_workers()]
    return max(paths, key=lambda p: len(os.fsencode(p)))


def ipc_path_refusal(config: Config) -> str | None:
    """Why this instance's ipc sockets cannot be made (a path longer than a Unix socket's
    may be: ZeroMQ would fail with "File name too long"), or None."""
    longest = longest_ipc_path(config)
    if longest is None or (size := len(os.fsencode(longest))) <= IPC_PATH_MAX:
        return None
    return (f"the runtime folder {config.runtime_path()} is too long for its sockets: {longest} "
            f"is {size} bytes, and a Unix socket's path may have at most {IPC_PATH_MAX}. Set "
            "runtime_dir (NPU_PROXY_RUNTIME_DIR) to a shorter folder, give the worker a "
            "shorter name, or use transport = \"tcp\"")


def request_limit(config: Config) -> int:
    """The largest request a worker takes off its socket."""
    return 2 * config.max_body_bytes + REQUEST_MARGIN


def _limit(sock: zmq.Socket[Any], config: Config) -> None:
    kind = sock.getsockopt(zmq.TYPE)
    if kind == zmq.PULL:
        sock.setsockopt(zmq.MAXMSGSIZE, request_limit(config))
    elif kind == zmq.REP:
        sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
    elif kind in (zmq.SUB, zmq.REQ, zmq.DEALER):
        sock.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes)
    elif kind == zmq.XPUB:
        sock.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_MAX_BYTES)


class _Allowed:
    """A ZAP credentials provider: the client keys one domain accepts."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        # NOTE: once per key: a refused peer retries its connection every 100 ms.
        if key not in self.refused:
            self.refused.add(key)
            log.warning("refused a ZeroMQ client with an unknown key %s on %s sockets",
                        key.decode(errors="replace"), domain)
        return False


# One ZAP handler per context that binds a tcp socket (ZeroMQ asks the handler of the
# socket's own context); stopped by `term`.
_guards: dict[int, ThreadAuthenticator] = {}
_guards_lock = threading.Lock()


def _guard(ctx: zmq.Context[Any], config: Config, keys: Keys) -> None:
    with _guards_lock:
        if id(ctx) in _guards:
            return
        # NOTE: imported here, on tcp only: it imports asyncio (0.04 s of CPU), which the
        # supervisor and a worker over ipc never need (bench/start.py).
        from zmq.auth.thread import ThreadAuthenticator

        # NOTE: the handler is a Python thread: while native code holds the GIL (a long
        # compile) new connections wait for it; connections already made are not affected.
        auth = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
        auth.start()
        auth.configure_curve_callback("local", _Allowed(frozenset([keys.client_public])))
        auth.configure_curve_callback("workers", _Allowed(worker_clients(config, keys)))
        _guards[id(ctx)] = auth


def bind(sock: zmq.Socket[Any], config: Config, endpoint: Endpoint) -> None:
    """Bind `sock` with this instance's security and size limit."""
    _limit(sock, config)
    if endpoint.tcp:
        keys = load_keys(config)
        _guard(sock.context, config, keys)
        sock.setsockopt(zmq.ZAP_DOMAIN, endpoint.domain.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.bind(endpoint.address)


def connect(sock: zmq.Socket[Any], config: Config, endpoint: Endpoint) -> None:
    """Connect `sock` with this instance's security and size limit."""
    _limit(sock, config)
    if endpoint.tcp:
        keys = load_keys(config)
        server = (public_key(endpoint.server_key_file) if endpoint.server_key_file
                  else keys.server_public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    sock.connect(endpoint.address)


def term(ctx: zmq.Context[Any]) -> None:
    """Stop the context's ZAP handler (if it has one), then terminate the context."""
    with _guards_lock:
        auth = _guards.pop(id(ctx), None)
    if auth is not None:
        auth.stop()
    ctx.term()


def configure_push(sock: zmq.Socket) -> None:  # type: ignore[type-arg]
    # NOTE: IMMEDIATE makes a send to a dead worker fail at once (EAGAIN) instead of queueing
    # a stale request for the worker's next incarnation.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10_000)


def configure_pub(sock: zmq.Socket) -> None:  # type: ignore[type-arg]
    sock.setsockopt(zmq.SNDHWM, PUB_HWM)
    sock.setsockopt(zmq.LINGER, 500)
    if sock.getsockopt(zmq.TYPE) == zmq.XPUB:
        # NOTE: a subscriber hears only what the worker grants it (protocol/replies.py).
        sock.setsockopt(zmq.XPUB_MANUAL, 1)


def reply_topic(client_key: bytes) -> bytes:
    """The topic of one gateway's frames: its CURVE client key (b"" on ipc), ended so that
    no topic is a prefix of another."""
    return TOPIC_REQUEST + client_key + b"\0"


def subscribe_replies(sock: zmq.Socket, config: Config,  # type: ignore[type-arg]
                      endpoint: Endpoint) -> None:
    """Subscribe a SUB to this instance's own replies from a worker (the topic of its client
    key on tcp); the worker sends it its heartbeats there too."""
    key = load_keys(config).client_public if endpoint.tcp else b""
    sock.setsockopt(zmq.SUBSCRIBE, reply_topic(key))


def configure_sub(sock: zmq.Socket, topic: bytes | None = b"") -> None:  # type: ignore[type-arg]
    """A SUB's buffers, subscribed to `topic` (None: to nothing yet)."""
    sock.setsockopt(zmq.RCVHWM, PUB_HWM)
    sock.setsockopt(zmq.LINGER, 0)
    if topic is not None:
        sock.setsockopt(zmq.SUBSCRIBE, topic)
