"""The worker process: sockets, threads, signals and state around one engine.

Threads: the main thread loads the model and then runs the engine loop; a receiver thread
decodes requests from the PULL socket and hands them to the engine; a heartbeat thread
publishes the worker's state and grants subscriptions. All XPUB use goes through one lock
(sockets are not thread-safe). Each gateway's frames go to it alone (protocol/replies.py).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.liveness import Heartbeat
from npu_proxy.protocol.messages import (
    Abort,
    ErrorCode,
    Failed,
    RequestFrame,
    WorkerRequest,
    encode,
    request_decoder,
)
from npu_proxy.protocol.replies import ReplyRoutes, user_id
from npu_proxy.protocol.sockets import (
    TOPIC_HEARTBEAT,
    bind,
    configure_pub,
    term,
    worker_endpoint,
)
from npu_proxy.protocol.states import ProcessState
from npu_proxy.workers.faults import gateway_heartbeats_held

if TYPE_CHECKING:
    # NOTE: for types only: the engine modules import OpenVINO (about 0.5 s here), which
    # build_engine() does after the heartbeat thread has started.
    from npu_proxy.workers.engine import Engine

log = logging.getLogger(__name__)
# NOTE: seconds between heartbeats: a constant, not a setting (nobody tuned it); the
# supervisor's per-worker heartbeat_timeout (10 s) is the knob that decides a worker is lost.
HEARTBEAT_INTERVAL = 0.5


class WorkerProcess:
    def __init__(self, config: Config, spec: WorkerSpec, recovering: bool = False) -> None:
        self.config = config
        self.spec = spec
        self.recovering = recovering
        self.state = ProcessState.STARTING
        self.error = ""
        self.load_seconds = 0.0
        self.engine: Engine | None = None
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        configure_pub(self._pub)
        self._pub_lock = threading.Lock()
        self.routes = ReplyRoutes(worker_endpoint(config, spec.name, "out").tcp)
        self._stop = threading.Event()
        self._draining = threading.Event()

    @property
    def stopping(self) -> threading.Event:
        """Set once the worker is to stop (after SIGTERM): a long wait inside a load (a GGUF
        conversion's child process) ends on it."""
        return self._stop

    # --- publishing ----------------------------------------------------------------------

    def publish(self) -> None:
        """A heartbeat of this moment, to every subscriber (subscriptions waiting are granted
        first)."""
        held = gateway_heartbeats_held(self.spec)
        with self._pub_lock:
            # NOTE: taken under the lock, so heartbeats leave in the order they were taken. The
            # heartbeat thread, given the GIL as a long step ended, took one that counted the
            # step as time without progress; the engine thread's announce then took and sent
            # the fresh one first, the stale one went last, and the next long step was killed
            # at the limit minus the step before (CI, a loaded machine).
            data = encode(self.heartbeat())
            self.routes.grant(self._pub)
            for topic in [TOPIC_HEARTBEAT] if held else self.routes.topics:
                self._pub.send_multipart((topic, data))

    def emit(self, frame: RequestFrame) -> None:
        """A request's frame, to the gateway that sent the request."""
        topic, frame = self.routes.outbound(frame)
        data = encode(frame)
        with self._pub_lock:
            self._pub.send_multipart((topic, data))

    def heartbeat(self) -> Heartbeat:
        engine = self.engine
        state = self.state
        if state == ProcessState.READY and engine is not None and engine.in_flight:
            state = ProcessState.BUSY
        return Heartbeat(
            worker=self.spec.name,
            pid=os.getpid(),
            role=self.spec.role,
            device=self.spec.device,
            model=self.spec.model_name,
            state=state,
            queue=engine.queue_depth if engine else 0,
            in_flight=engine.in_flight if engine else 0,
            served=engine.served if engine else 0,
            generated_tokens=engine.generated_tokens if engine else 0,
            load_seconds=self.load_seconds,
            cache_hits=getattr(engine, "cache_hits", 0),
            cache_misses=getattr(engine, "cache_misses", 0),
            error=self.error,
            sent_at=time.time(),
            stalled_for=(time.monotonic() - engine.progress_at
                         if engine is not None and engine.in_flight else 0.0),
            blocking=engine.blocking if engine is not None else False,
            embed_batches=list(getattr(engine, "batches", [])) or None,
            recovering=self.recovering,
        )

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.publish()
            except zmq.ZMQError:
                return
            self._stop.wait(HEARTBEAT_INTERVAL)

    # --- receiving -----------------------------------------------------------------------

    def _receive_loop(self) -> None:
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        bind(pull, self.config, worker_endpoint(self.config, self.spec.name, "in"))
        decoder = request_decoder()
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        routed = self.routes.tcp
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            # NOTE: on tcp the message's User-Id (its sender's client key) says which
            # gateway's request it is; ipc has one gateway and takes the plain path.
            key = ""
            if routed:
                frame = pull.recv(copy=False)
                raw, key = frame.bytes, user_id(frame)
            else:
                raw = pull.recv()
            try:
                msg = decoder.decode(raw)
            except msgspec.DecodeError as exc:
                log.error("undecodable request dropped: %s", exc)
                continue
            self.routes.inbound(msg, key)
            self._dispatch(msg)
        pull.close()

    def _dispatch(self, msg: WorkerRequest) -> None:
        engine = self.engine
        if isinstance(msg, Abort):
            if engine is not None:
                engine.submit(msg)
            return
        if engine is None or not self.state.serving or self._draining.is_set():
            self.emit(Failed(id=msg.id, seq=0, code=ErrorCode.NOT_READY,
                             message=f"worker {self.spec.name} is {self.state.label}",
                             retry_elsewhere=True))
            return
        # NOTE: answered at once, never queued: a full worker says so and the gateway tries
        # the next worker for the model, else answers 503 with Retry-After. Only this thread
        # submits, so the room seen here is still there when submit() takes it.
        if not engine.has_room():
            self.emit(Failed(id=msg.id, seq=0, code=ErrorCode.QUEUE_FULL,
                             message=f"worker {self.spec.name} is full ({engine.in_flight} "
                                     f"running, {engine.queue_depth} waiting)",
                             retry_elsewhere=True))
            return
        engine.submit(msg)

    # --- life cycle ----------------------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: object) -> None:
        log.info("SIGTERM: draining")
        self._draining.set()

    def _drain_watch(self) -> None:
        """After SIGTERM: let in-flight work finish within the grace period, then stop."""
        self._draining.wait()
        self.state = ProcessState.DRAINING
        deadline = time.monotonic() + max(0.0, self.config.grace_period - 1.0)
        while time.monotonic() < deadline:
            engine = self.engine
            if engine is None or (engine.in_flight == 0 and engine.queue_depth == 0):
                break
            time.sleep(0.05)
        engine = self.engine
        if engine is not None and engine.in_flight:
            engine.abort_all("abort")
            time.sleep(0.2)
        self._stop.set()

    def run(self, build_engine: Any) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, self._on_sigterm)
        bind(self._pub, self.config, worker_endpoint(self.config, self.spec.name, "out"))
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        threading.Thread(target=self._drain_watch, name="drain", daemon=True).start()
        receiver = threading.Thread(target=self._receive_loop, name="receiver", daemon=True)
        receiver.start()
        try:
            self.state = ProcessState.LOADING
            started = time.monotonic()
            if self.spec.faults.crash_in_load:
                raise RuntimeError("fault hook: crash in load")
            if self.spec.faults.hang_in_load:
                log.error("fault hook: hanging in load")
                while not self._stop.is_set():
                    time.sleep(0.1)
            if self.spec.faults.hold_load_until:
                held = Path(self.spec.faults.hold_load_until)
                log.error("fault hook: loading held until %s exists", held)
                while not held.exists() and not self._stop.is_set():
                    time.sleep(0.1)
            engine: Engine = build_engine(self)
            engine.announce = self.publish  # NOTE: a heartbeat now, from the engine thread
            engine.load(self._compile_properties())
            # NOTE: bench/start.py reads this line: where a start's time goes.
            log.info("pipeline built in %.1f s", time.monotonic() - started)
            self.engine = engine
            self.state = ProcessState.WARMING
            engine.warm_up()
            self.load_seconds = time.monotonic() - started
            log.info("ready in %.1f s", self.load_seconds)
            self.state = ProcessState.READY
            self.publish()
            engine.run(self._stop)
        except Exception as exc:
            if self._draining.is_set() and self.engine is None:
                # NOTE: told to stop while loading (a conversion was ended): not a failure.
                log.info("stopped while loading: %s", exc)
                return self._stopped(receiver)
            log.exception("worker failed")
            self.state = ProcessState.FAILED
            self.error = str(exc)
            self.publish()
            time.sleep(0.2)
            self._stop.set()
            receiver.join(1.0)
            return 1
        return self._stopped(receiver)

    def _stopped(self, receiver: threading.Thread) -> int:
        self.state = ProcessState.STOPPED
        self.publish()
        receiver.join(1.0)
        time.sleep(0.05)
        self._pub.close(linger=200)
        term(self._ctx)
        return 0

    def _compile_properties(self) -> dict[str, Any]:
        cache = self.config.model_cache_path() / "ov_cache" / self.spec.device.lower()
        cache.mkdir(parents=True, exist_ok=True)
        properties: dict[str, Any] = {"CACHE_DIR": str(cache), **self.spec.properties}
        log.info("loading %s on %s with properties %s", self.spec.model_name, self.spec.device,
                 properties)
        return properties
