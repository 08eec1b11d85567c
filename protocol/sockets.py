"""ZeroMQ endpoints and socket options, in one place for every process.

Each worker binds `<name>.in` (PULL: requests, aborts) and `<name>.out` (PUB: everything it
says). The gateway connects a PUSH to each `.in` and a SUB to each `.out`; the supervisor
subscribes to every `.out` for heartbeats and serves the control socket.
"""

from __future__ import annotations

from typing import Literal

import zmq

from protocol.config import Config

# NOTE: PUB drops at the high-water mark. A worker emits at most a few frames per request per
# decode step; 100k frames is far beyond any burst a single device produces.
PUB_HWM = 100_000

# NOTE: the first frame of every PUB message is a topic, so the supervisor can subscribe to
# heartbeats alone and never decode token frames.
TOPIC_HEARTBEAT = b"h"
TOPIC_REQUEST = b"r"


def _tcp_port(config: Config, index: int) -> int:
    return config.tcp_base_port + index


def worker_endpoint(config: Config, worker: str, direction: Literal["in", "out"]) -> str:
    if config.transport == "tcp":
        names = [w.name for w in config.workers]
        index = names.index(worker)
        port = _tcp_port(config, 2 + 2 * index + (0 if direction == "in" else 1))
        return f"tcp://127.0.0.1:{port}"
    return f"ipc://{config.runtime_path() / f'{worker}.{direction}'}"


def control_endpoint(config: Config) -> str:
    if config.transport == "tcp":
        return f"tcp://127.0.0.1:{_tcp_port(config, 0)}"
    return f"ipc://{config.runtime_path() / 'control'}"


def events_endpoint(config: Config) -> str:
    """The supervisor's PUB socket: worker exits and state changes, for the gateway."""
    if config.transport == "tcp":
        return f"tcp://127.0.0.1:{_tcp_port(config, 1)}"
    return f"ipc://{config.runtime_path() / 'events'}"


def configure_push(sock: zmq.Socket) -> None:  # type: ignore[type-arg]
    # NOTE: IMMEDIATE makes a send to a dead worker fail at once (EAGAIN) instead of queueing
    # a stale request for the worker's next incarnation.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10_000)


def configure_pub(sock: zmq.Socket) -> None:  # type: ignore[type-arg]
    sock.setsockopt(zmq.SNDHWM, PUB_HWM)
    sock.setsockopt(zmq.LINGER, 500)


def configure_sub(sock: zmq.Socket, topic: bytes = b"") -> None:  # type: ignore[type-arg]
    sock.setsockopt(zmq.RCVHWM, PUB_HWM)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
