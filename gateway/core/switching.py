"""Switching a worker to the model a request names, and back when it idles (keep_alive).

A request for a model that no worker runs (pulled, or a worker's configured model while that
worker runs another) picks a worker of the right kind that may switch (`allow_switch`, off
for npu by default: a cold NPU compile takes minutes), asks the supervisor over its control
socket to reload it with that model (`control.Load`: the supervisor rewrites the
worker's spec and restarts it, draining in-flight work) and waits, up to `switch_timeout`,
until the worker's heartbeats say it is serving that model. Requests for the same worker
wait on one lock, so a burst causes one switch.

keep_alive: a worker running a model other than its configured one goes back to its
configured model once it has been idle for the last keep_alive given for that model
(Ollama's default five minutes; 0 = as soon as it is idle; negative = never). The Switcher is
the one place a model's keep_alive and last request are kept; /api/ps reports `expires_at`
from them.

Lazy workers (started by a request, unloaded after their own keep_alive) are the Residency's
(gateway/core/residency.py), which shares the Switcher's per-worker locks and last use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from npu_proxy.gateway.core.errors import GatewayError, unavailable
from npu_proxy.gateway.core.keep_alive import DEFAULT_KEEP_ALIVE
from npu_proxy.gateway.core.model_table import ROLE_KIND
from npu_proxy.gateway.core.residency import Residency, ask
from npu_proxy.models.gguf import unreadable_file
from npu_proxy.protocol import control
from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.states import ProcessState

if TYPE_CHECKING:
    from npu_proxy.gateway.core.broker import Broker
    from npu_proxy.gateway.core.model_table import ModelTable, ServedModel

log = logging.getLogger(__name__)

REAP_INTERVAL = 0.5


class Switcher:
    def __init__(self, config: Config, broker: Broker, table: ModelTable) -> None:
        self.config = config
        self.broker = broker
        self.table = table
        self.locks: dict[str, asyncio.Lock] = {}
        # worker -> the model it is being switched to
        self.pending: dict[str, str] = {}
        # worker -> monotonic time it was last seen busy or given a request
        self.used_at: dict[str, float] = {}
        # model -> keep_alive in seconds (math.inf = forever), the last one a request gave
        self.keep_alive: dict[str, float] = {}
        # model -> wall-clock time of that request (what /api/ps counts expires_at from)
        self.touched_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.residency = Residency(config, broker, table, self.locks, self.used_at,
                                   self.keep_alive, self.pending)

    # --- requests ------------------------------------------------------------------------

    def touch(self, name: str, keep_alive: float) -> None:
        """A request named `name` with this keep_alive; a positive one on a model no worker
        runs starts loading it (Ollama's empty-prompt load)."""
        name = self.table.canonical(name)
        model = self.table.models().get(name)
        # NOTE: a created model over another one keeps that one loaded: the reaper asks by
        # the model a worker runs.
        name = model.runs if model is not None else name
        self.keep_alive[name] = keep_alive
        self.touched_at[name] = time.time()
        if model is None:
            return
        self._mark(model.workers)
        if keep_alive > 0 and (not model.workers or self.residency.sleeper(model.workers)):
            self._spawn(self.ensure(model))

    def expires_at(self, name: str) -> float:
        """Wall-clock time the last request's keep_alive for `name` runs out; math.inf for
        forever, and for a model no request named yet (its worker loaded it at start-up)."""
        name = self.table.canonical(name)
        model = self.table.models().get(name)
        if model is not None and (lazy := self.residency.expires_at(model)) is not None:
            return lazy
        name = model.runs if model is not None else name
        since = self.touched_at.get(name)
        return math.inf if since is None else since + self.keep_alive[name]

    def _mark(self, workers: list[str]) -> None:
        now = time.monotonic()
        for worker in workers:
            self.used_at[worker] = now

    async def ensure(self, model: ServedModel) -> ServedModel:
        """The model with a worker running it, switching one to it if need be."""
        if model.workers:
            self._mark(model.workers)
            links = self.broker.links
            switching = [w for w in model.workers if self.pending.get(w) == model.runs]
            if switching and not any(links[w].serving for w in model.workers if w in links):
                await self.load(switching[0], model.runs)
            await self.residency.ready(model.workers)
            self._mark(model.workers)
            return model
        worker = self.pick(model)
        await _readable(model)
        await self.load(worker, model.runs)
        fresh = self.table.models().get(model.name)
        if fresh is None or not fresh.workers:
            raise unavailable(f"model '{model.name}' was unloaded again; retry")
        self._mark(fresh.workers)
        return fresh

    def pick(self, model: ServedModel) -> str:
        """The worker to switch to `model`, or a 400 that says how to allow it."""
        kind = {"embed": "embedding", "vlm": "vision-language",
                "rerank": "reranking", "asr": "speech-recognition",
                "tts": "text-to-speech"}.get(
                    model.kind, "text generation")
        candidates = [s for s in self.config.workers
                      if s.enabled and ROLE_KIND[s.role] == model.kind]
        if not candidates:
            raise GatewayError(400, "invalid_request",
                               f"model '{model.name}' is a {kind} model and no worker of that "
                               "kind is configured", param="model")
        allowed = [s for s in candidates if s.allow_switch]
        if not allowed:
            names = ", ".join(f"'{s.name}' (role {s.role})" for s in candidates)
            raise GatewayError(
                400, "invalid_request",
                f"model '{model.name}' is not loaded and no worker may switch to it: "
                f"switching models is off for {names} (allow_switch = false; the default for "
                "the npu role, where a cold compile takes minutes). To allow it, set "
                "allow_switch = true in that worker's [[workers]] section of the config file "
                "and restart the worker (npx-supervisor restart <worker>)", param="model")

        def rank(spec: WorkerSpec) -> tuple[int, int, int, int]:
            link = self.broker.links.get(spec.name)
            busy = bool(link and (link.requests or (link.heartbeat and link.heartbeat.in_flight)))
            return (0 if self.table.default_model(spec) == model.runs else 1,
                    0 if self.table.current_model(spec) != self.table.default_model(spec)
                    else 1,
                    1 if busy else 0,
                    1 if spec.role == "npu" else 0)

        return min(allowed, key=rank).name

    # --- switching -----------------------------------------------------------------------

    async def load(self, worker: str, model: str) -> None:
        """Reload `worker` with `model` ("" = its configured model); return once it serves it."""
        spec = self.config.worker(worker)
        home = self.table.default_model(spec)
        target = model or home
        lock = self.locks.setdefault(worker, asyncio.Lock())
        deadline = time.monotonic() + self.config.switch_timeout
        try:
            await asyncio.wait_for(lock.acquire(), self.config.switch_timeout)
        except TimeoutError:
            raise GatewayError(504, "timeout", f"worker {worker} was busy switching models for "
                               f"{self.config.switch_timeout:.0f} s") from None
        try:
            link = self.broker.links.get(worker)
            if link is None:
                raise unavailable(f"worker {worker} is not running")
            if self.table.current_model(spec) == target and link.serving:
                return
            old_pid = link.heartbeat.pid if link.heartbeat is not None else 0
            self.pending[worker] = target
            log.info("switching worker %s to model %s", worker, target,
                     extra={"worker": worker})
            command = control.Load(worker=worker, model="" if target == home else target)
            reply = await ask(self.config, command, control.Loaded,
                              f"switch worker {worker} to '{target}'")
            try:
                await self._wait(worker, target, old_pid if reply.changed else -1, deadline)
            except GatewayError:
                if target != home:
                    self._spawn(self._revert(worker))
                raise
            self.used_at[worker] = time.monotonic()
            log.info("worker %s serves model %s", worker, target, extra={"worker": worker})
        finally:
            self.pending.pop(worker, None)
            lock.release()

    async def _revert(self, worker: str) -> None:
        await asyncio.sleep(0)  # NOTE: after the failed load released the worker's lock
        await self.load(worker, "")

    async def _wait(self, worker: str, target: str, old_pid: int, deadline: float) -> None:
        link = self.broker.links[worker]
        seen_other = False
        while True:
            beat = link.heartbeat
            if beat is not None and beat.pid != old_pid and \
                    self.table.canonical(beat.model) == target:
                if link.serving:
                    return
                if beat.state == ProcessState.FAILED:
                    raise GatewayError(500, "internal", f"worker {worker} failed to load model "
                                       f"'{target}': {beat.error or 'see its log'}")
            sup = link.supervised
            if sup is not None and sup.state == ProcessState.FAILED and seen_other:
                raise GatewayError(500, "internal", f"worker {worker} failed to load model "
                                   f"'{target}': {sup.last_error or 'see its log'}")
            seen_other = seen_other or sup is None or sup.state != ProcessState.FAILED
            if time.monotonic() > deadline:
                raise GatewayError(504, "timeout", f"worker {worker} did not become ready "
                                   f"with model '{target}' within {self.config.switch_timeout:.0f}"
                                   " s (switch_timeout)")
            await asyncio.sleep(0.1)

    # --- keep_alive ----------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            try:
                self._reap()
            except Exception:
                log.exception("keep_alive check failed")

    def _reap(self) -> None:
        now = time.monotonic()
        self.residency.reap(now)
        for spec in self.config.workers:
            # NOTE: a worker with a keep_alive of its own is unloaded, not switched back.
            if not spec.enabled or not spec.allow_switch or spec.idle_stop is not None:
                continue
            link = self.broker.links.get(spec.name)
            lock = self.locks.get(spec.name)
            if link is None or link.heartbeat is None or spec.name in self.pending or \
                    (lock is not None and lock.locked()):
                continue
            current = self.table.current_model(spec)
            if current == self.table.default_model(spec):
                continue
            beat = link.heartbeat
            if link.requests or beat.in_flight or beat.queue or not link.serving:
                self.used_at[spec.name] = now
                continue
            keep = self.keep_alive.get(current, DEFAULT_KEEP_ALIVE)
            idle = now - self.used_at.setdefault(spec.name, now)
            if not math.isinf(keep) and idle >= keep:
                log.info("unloading model %s from worker %s: idle %.0f s (keep_alive %.0f s)",
                         current, spec.name, idle, keep, extra={"worker": spec.name})
                self._spawn(self.load(spec.name, ""))

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("background model switch failed: %s", exc)

    async def stop(self) -> None:
        await self.residency.stop()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _readable(model: ServedModel) -> None:
    """A 400 naming what to use instead for a GGUF file OpenVINO GenAI cannot read, before
    a worker is switched to it: its model would be unloaded for a load bound to fail."""
    if model.kind not in ("llm", "vlm") or not model.path.lower().endswith(".gguf"):
        return  # NOTE: other kinds' GGUFs are read by this server's own converters
    if why := await asyncio.to_thread(unreadable_file, Path(model.path)):
        raise GatewayError(400, "invalid_request", f"model '{model.name}' cannot be served "
                           f"here: {why}", param="model")
