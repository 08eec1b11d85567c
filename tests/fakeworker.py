"""A worker's two sockets, bound by a test in place of a worker process, for tests that drive
the gateway's broker directly (test_broker, test_stream_coalescing, test_worker_identity)."""

from __future__ import annotations

import asyncio
import time

import zmq

from npu_proxy.gateway.core.worker_link import WorkerLink
from npu_proxy.protocol.config import Config
from npu_proxy.protocol.liveness import Heartbeat
from npu_proxy.protocol.messages import encode
from npu_proxy.protocol.sockets import bind, configure_pub, reply_topic, worker_endpoint

# The one gateway's topic on ipc: its heartbeats and its requests' frames.
LOCAL = reply_topic(b"")


def worker_sockets(ctx: zmq.Context[zmq.Socket[bytes]], config: Config, name: str,
                   ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """The PULL the broker sends worker `name` its requests on, and the PUB it hears from."""
    pull = ctx.socket(zmq.PULL)
    bind(pull, config, worker_endpoint(config, name, "in"))
    pub = ctx.socket(zmq.PUB)
    configure_pub(pub)
    bind(pub, config, worker_endpoint(config, name, "out"))
    return pull, pub


async def until_heard(link: WorkerLink, pub: zmq.Socket[bytes], beat: Heartbeat) -> None:
    """Publish `beat` until the broker has heard one: a SUB hears a PUB only once its
    subscription arrived."""
    deadline = time.monotonic() + 30
    while link.heartbeat is None:
        assert time.monotonic() < deadline, "the broker never heard the worker"
        pub.send_multipart((LOCAL, encode(beat)))
        await asyncio.sleep(0.01)
