"""The gateway's side of ZeroMQ: one link per worker, frames dispatched by request id.

A request's frames carry consecutive sequence numbers; a gap means PUB dropped a frame and
the request fails with a clear error instead of delivering corrupted text.

What the gateway knows of each worker, and its state, is its WorkerLink
(gateway/core/worker_link.py); the Broker owns the sockets and moves the frames.

A request in flight when its worker crashed (exited, hung, went silent; not an operator's
stop or restart) may be what crashed it: the same request (its fingerprint: the message
without its ids, deadline and seed) is refused with a 400 for `crash_quarantine_seconds`, so a
client's retries cannot take the worker down again and again; the log names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
import zmq
import zmq.asyncio

from npu_proxy.gateway.core.errors import GatewayError
from npu_proxy.gateway.core.request_stream import RequestStream, fingerprint
from npu_proxy.gateway.core.worker_link import WorkerLink, WorkerUnavailable
from npu_proxy.protocol.config import Config
from npu_proxy.protocol.liveness import (
    EMBED_BATCH_CLASSES,
    Heartbeat,
    WorkerExited,
    WorkerStatus,
    event_decoder,
)
from npu_proxy.protocol.messages import (
    Abort,
    ErrorCode,
    Failed,
    WorkerReply,
    encode,
    reply_decoder,
)
from npu_proxy.protocol.sockets import (
    configure_push,
    configure_sub,
    connect,
    events_endpoint,
    request_limit,
    subscribe_replies,
    worker_endpoint,
)
from npu_proxy.protocol.states import ProcessState

log = logging.getLogger(__name__)

class Quarantine:
    """Fingerprints of the requests in flight when their worker crashed, refused a while."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._until: dict[str, tuple[float, str]] = {}

    def add(self, fingerprints: list[tuple[str, str]], why: str) -> None:
        """(request id, fingerprint) pairs of the requests a crash ended."""
        if self.seconds <= 0:
            return
        until = time.monotonic() + self.seconds
        for request_id, fp in fingerprints:
            self._until[fp] = (until, why)
            log.error("request_id=%s fingerprint=%s was in flight when %s: the same request "
                      "is refused for %.0f s", request_id, fp, why, self.seconds)

    def check(self, msg: msgspec.Struct, request_id: str) -> str:
        """A 400 for a request a crash put here, while it is here; its fingerprint, or ""
        when none is held (not computed then: an encoding of the request saved per send)."""
        now = time.monotonic()
        for stale in [k for k, (until, _) in self._until.items() if until <= now]:
            del self._until[stale]
        if not self._until:
            return ""
        fp = fingerprint(msg)
        if (hit := self._until.get(fp)) is None:
            return fp
        until, why = hit
        log.warning("request_id=%s fingerprint=%s refused: in flight when %s", request_id, fp,
                    why)
        raise GatewayError(400, "invalid_request",
                           f"this request was being processed when {why}; the same request "
                           f"is refused for another {until - now:.0f} s so that it cannot take "
                           "the worker down again (crash_quarantine_seconds)")


class Broker:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.ctx = zmq.asyncio.Context()
        self.links: dict[str, WorkerLink] = {}
        # NOTE: plain (blocking-API) views of the links' PUSH sockets, for sends that never
        # wait: the asyncio socket answers a NOBLOCK send with a Future (its zmq.Again lands
        # in that Future, never raised), which costs more than the send on every request.
        self._push_now: dict[str, zmq.Socket[bytes]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.listeners: list[object] = []
        self._misnamed: set[str] = set()  # links that sent heartbeats naming another worker
        self.quarantine = Quarantine(config.crash_quarantine_seconds)

    def idle(self, worker: str) -> bool:
        """The worker is not loaded (lazy, or unloaded after its keep_alive)."""
        link = self.links.get(worker)
        return link is not None and link.idle

    async def start(self) -> None:
        for spec in self.config.workers:
            if not spec.enabled:
                continue
            push = self.ctx.socket(zmq.PUSH)
            configure_push(push)
            connect(push, self.config, worker_endpoint(self.config, spec.name, "in"))
            sub = self.ctx.socket(zmq.SUB)
            out = worker_endpoint(self.config, spec.name, "out")
            # NOTE: not to the heartbeat topic: the worker sends this gateway its heartbeats
            # on its own reply topic, so hearing one proves its frames reach it too.
            configure_sub(sub, None)
            subscribe_replies(sub, self.config, out)
            connect(sub, self.config, out)
            link = WorkerLink(spec=spec, push=push, sub=sub,
                              busy_limit=self.config.inference_timeout)
            self.links[spec.name] = link
            self._push_now[spec.name] = zmq.Socket.shadow(push.underlying)
            self._tasks.append(asyncio.create_task(self._read(link)))
        self._tasks.append(asyncio.create_task(self._watch()))
        self._tasks.append(asyncio.create_task(self._events()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for link in self.links.values():
            link.push.close(0)
            link.sub.close(0)
        self.ctx.term()

    # --- sending -------------------------------------------------------------------------

    def open(self, worker: str, request_id: str, msg: msgspec.Struct) -> RequestStream:
        """Send a request and register the stream its frames arrive on."""
        link = self.links[worker]
        fp = self.quarantine.check(msg, request_id)
        data = encode(msg)
        limit = request_limit(self.config)
        if len(data) > limit:
            # NOTE: checked here, at the sender: the worker's socket drops the connection on a
            # larger message (MAXMSGSIZE), and with it the requests and aborts queued behind.
            log.warning("request_id=%s refused: its message is %d bytes, over the workers' "
                        "limit of %d", request_id, len(data), limit)
            raise GatewayError(413, "request_too_large",
                               f"the request grows to {len(data)} bytes once prepared for the "
                               f"worker (tools, schemas, history), over the limit of {limit} "
                               "bytes (2 * max_body_bytes + 1 MiB)")
        stream = RequestStream(id=request_id, worker=worker, msg=msg, fingerprint=fp)
        link.requests[request_id] = stream
        try:
            self._push_now[worker].send(data, flags=zmq.NOBLOCK)
        except zmq.Again as exc:
            del link.requests[request_id]
            raise WorkerUnavailable(f"worker {worker} is not connected") from exc
        return stream

    def close(self, stream: RequestStream) -> None:
        stream.cancel_timer()
        link = self.links.get(stream.worker)
        if link is not None:
            link.requests.pop(stream.id, None)

    def release(self, stream: RequestStream, ended: bool = False) -> None:
        """Stop listening to a request and, unless its worker `ended` it, tell the worker to
        stop it: also when the broker already gave it up (a frame gap, a lost heartbeat), as
        the worker may still be working on it. A worker that knows no such request ignores
        the abort."""
        if not ended:
            self.send(stream.worker, Abort(id=stream.id))
        self.close(stream)

    def send(self, worker: str, msg: msgspec.Struct) -> None:
        """Fire and forget (aborts). Never awaits, so it is safe in a cancelled task."""
        with contextlib.suppress(zmq.ZMQError):
            self._push_now[worker].send(encode(msg), flags=zmq.NOBLOCK)

    # --- receiving -----------------------------------------------------------------------

    async def _read(self, link: WorkerLink) -> None:
        decoder = reply_decoder()
        # NOTE: the socket's file descriptor watched by the loop itself, every frame taken
        # through a plain view of the socket: zmq.asyncio's recv costs a Future and an event
        # dispatch with enum flag checks per wake-up, per streamed token at 32 streams. The
        # descriptor is edge-triggered: it is waited on only after EVENTS said no frame is
        # there (reading EVENTS re-arms it), as ZeroMQ's documentation prescribes.
        sock: zmq.Socket[bytes] = zmq.Socket.shadow(link.sub.underlying)
        fd = int(sock.getsockopt(zmq.FD))
        loop = asyncio.get_running_loop()
        wake: list[asyncio.Future[None]] = []

        def readable() -> None:
            if wake and not wake[0].done():
                wake[0].set_result(None)

        loop.add_reader(fd, readable)
        try:
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    if int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                        continue
                    wake.append(loop.create_future())
                    try:
                        await wake[0]
                    finally:
                        wake.clear()
                    continue
                self._deliver(link, decoder, frames[-1])
        finally:
            loop.remove_reader(fd)

    def _deliver(self, link: WorkerLink, decoder: msgspec.msgpack.Decoder[WorkerReply],
                 raw: bytes) -> None:
        try:
            msg = decoder.decode(raw)
        except msgspec.DecodeError as exc:
            log.error("undecodable frame from %s: %s", link.name, exc)
            return
        if isinstance(msg, Heartbeat):
            if msg.worker != link.name or \
                    len(msg.embed_batches or ()) > len(EMBED_BATCH_CLASSES):
                # NOTE: a heartbeat is the link's own or nothing: one naming another worker
                # (a remote peer's, or a forged one) must not speak for that worker, nor
                # add metric series (more batch size classes than there are).
                if link.name not in self._misnamed:
                    self._misnamed.add(link.name)
                    log.warning("ignoring heartbeats from worker %s that name %r or more "
                                "batch classes than there are", link.name, msg.worker[:64],
                                extra={"worker": link.name})
                return
            self._on_heartbeat(link, msg)
            return
        stream = link.requests.get(msg.id)
        if stream is None:
            return
        if msg.seq != stream.next_seq:
            log.error("frame gap on request_id=%s: expected seq %d, got %d",
                      msg.id, stream.next_seq, msg.seq)
            self._fail(link, stream, ErrorCode.INTERNAL,
                       "frames from the worker were lost; the output would be corrupt")
            return
        stream.next_seq += 1
        stream.put(msg)

    def _on_heartbeat(self, link: WorkerLink, beat: Heartbeat) -> None:
        previous = link.heartbeat
        link.heartbeat = beat
        link.seen_at = time.monotonic()
        if previous is None or previous.state != beat.state or previous.pid != beat.pid:
            log.info("worker %s pid %d is %s", link.name, beat.pid, beat.state.label,
                     extra={"worker": link.name, "device": beat.device})
        if previous is not None and previous.pid != beat.pid:
            self._fail_all(link, f"worker {link.name} restarted")
        elif beat.state in (ProcessState.FAILED, ProcessState.STOPPED,
                            ProcessState.STARTING, ProcessState.LOADING):
            self._fail_all(link, f"worker {link.name} is {beat.state.label}")
        for listener in self.listeners:
            callback = getattr(listener, "on_heartbeat", None)
            if callback is not None:
                callback(link, beat)

    def _fail(self, link: WorkerLink, stream: RequestStream, code: ErrorCode,
              message: str) -> None:
        link.requests.pop(stream.id, None)
        stream.put(Failed(id=stream.id, seq=stream.next_seq, code=code,
                                        message=message))

    def _fail_all(self, link: WorkerLink, message: str) -> None:
        for stream in list(link.requests.values()):
            self._fail(link, stream, ErrorCode.WORKER_LOST, message)

    def worker_lost(self, name: str, reason: str, crashed: bool = True) -> None:
        """Fail the worker's requests in flight; if it `crashed` (not ended by the
        supervisor on an operator's word), each of them is quarantined."""
        link = self.links.get(name)
        if link is None:
            return
        if link.requests:
            log.error("worker %s lost (%s); failing %d request(s)", name, reason,
                      len(link.requests), extra={"worker": name})
            if crashed:  # NOTE: an operator's stop or restart is no request's fault
                why = f"worker {name} {reason}"
                for stream in link.requests.values():
                    stream.crashed = why
                    stream.crashed_with = len(link.requests)
                self.quarantine.add([(s.id, s.fingerprint) for s in link.requests.values()
                                     if not s.resumable], why)
        self._fail_all(link, f"worker {name} {reason}")

    def on_status(self, status: WorkerStatus) -> None:
        """The supervisor's state of a worker (on change, and once a second)."""
        link = self.links.get(status.worker)
        if link is None:
            return
        previous = link.supervised
        if previous is None or previous.pid != status.pid:
            link.pid_since = time.monotonic()
        link.supervised = status
        if status.state == ProcessState.UNRESPONSIVE and (
                previous is None or previous.state != status.state or previous.pid != status.pid):
            # NOTE: the supervisor found it hung (for a worker silent inside a pipeline step:
            # stopped or deadlocked, by its CPU time) and is killing it; its requests end
            # now rather than when the exit is seen. Its state now routes nothing to it.
            self.worker_lost(link.name, f"is unresponsive: {status.last_error}")
        for listener in self.listeners:
            callback = getattr(listener, "on_status", None)
            if callback is not None:
                callback(status)

    async def _watch(self) -> None:
        """Fail requests on a worker whose heartbeats stopped (hung or silently dead).

        NOTE: a worker silent inside a pipeline step (`blocking`) gets stall_timeout here, as
        a long prefill may take that long; the supervisor, which can read its CPU time, says
        sooner when it is stopped or deadlocked (`on_status`)."""
        while True:
            await asyncio.sleep(0.2)
            for link in self.links.values():
                if link.requests and link.heartbeat_age() > link.silence_allowed():
                    self.worker_lost(link.name, "stopped sending heartbeats")

    async def _events(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        configure_sub(sub)
        connect(sub, self.config, events_endpoint(self.config))
        decoder = event_decoder()
        try:
            while True:
                raw = await sub.recv()
                try:
                    event = decoder.decode(raw)
                except msgspec.DecodeError:
                    continue
                if isinstance(event, WorkerStatus):
                    self.on_status(event)
                    continue
                if isinstance(event, WorkerExited):
                    self.worker_lost(event.worker, f"exited (code {event.returncode})",
                                     crashed=not event.expected)
                    for listener in self.listeners:
                        callback = getattr(listener, "on_worker_exited", None)
                        if callback is not None:
                            callback(event)
        finally:
            sub.close(0)
