"""Lazy workers: started on the first request that needs them, unloaded once idle.

A lazy worker (`WorkerSpec.lazy`: embed and rerank by default, and any worker whose model is
not the default one) has no process until a request needs it; the supervisor holds it `idle`
(not loaded). Every request passes `Residency.ready` (through the Switcher): when none of the
model's workers serves and one is idle, the gateway asks the supervisor to start it
(control.Start) and waits until it serves, within its load deadline. Concurrent requests wait
on that one start; a client that leaves stops waiting, the start goes on for the others. A
start that fails (its new process exits, the worker ends failed or stopped, or the load
deadline passes) is a 503 with Retry-After in the caller's API. The same wait serves a worker
loading for the first time (within its load deadline) and one this gateway has not heard yet
(within its heartbeat_timeout: `Residency.unheard`), such as another host's worker right after
the gateway started.

The idle stop is decided here, where every request is seen: a worker with a keep_alive
(`WorkerSpec.idle_stop`) with no request in flight for that long is unloaded
(control.Unload): the supervisor drains it and holds it idle, with no restart and no backoff,
as Ollama unloads a model after its keep_alive. Starting, unloading and model switching take
the worker's one lock (the Switcher's), so they never interleave; a worker being unloaded
takes no new request (those wait for its next start).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING, TypeVar

import msgspec

from npu_proxy.gateway.core.errors import unavailable
from npu_proxy.protocol import control
from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.liveness import Heartbeat, WorkerExited, WorkerStatus
from npu_proxy.protocol.states import ProcessState

if TYPE_CHECKING:
    from npu_proxy.gateway.core.broker import Broker
    from npu_proxy.gateway.core.model_table import ModelTable, ServedModel
    from npu_proxy.gateway.core.worker_link import WorkerLink

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = 10.0
# NOTE: a wait for a worker's state wakes on its news (a heartbeat, the supervisor's status,
# an exit: `Residency._news_of`), so a worker's ready heartbeat, sent the moment it is ready,
# ends it at once; this bounds only what ends by time passing (a silent worker, a deadline).
POLL = 0.25
# Retry-After of a start that failed: the supervisor restarts it with backoff meanwhile.
FAILED_START_RETRY = 5

R = TypeVar("R", bound=msgspec.Struct)

_DOWN = (ProcessState.FAILED, ProcessState.STOPPED)
# NOTE: a first load that ends in these is a restart now: its requests get the 503.
_RESTARTING = (*_DOWN, ProcessState.BACKOFF, ProcessState.UNRESPONSIVE)


async def ask(config: Config, command: control.Command, expect: type[R], what: str) -> R:
    """One control command to the supervisor, in a thread (the event loop never waits); a
    supervisor that does not answer or refuses is a 503."""
    try:
        return await asyncio.to_thread(control.call, config, command, expect, CONTROL_TIMEOUT)
    except control.NoSupervisor:
        raise unavailable("the supervisor does not answer on its control socket") from None
    except control.ControlError as exc:
        raise unavailable(f"the supervisor refused to {what}: {exc}") from None


class Residency:
    """Starts and unloads lazy workers. Shares with the Switcher (which makes it) the
    per-worker locks, the workers' last use, the models' requested keep_alive and the
    workers being switched."""

    def __init__(self, config: Config, broker: Broker, table: ModelTable,
                 locks: dict[str, asyncio.Lock], used_at: dict[str, float],
                 keep_alive: dict[str, float], pending: dict[str, str]) -> None:
        self.config = config
        self.broker = broker
        self.table = table
        self.locks = locks
        self.used_at = used_at
        self.keep_alive = keep_alive
        self.pending = pending
        # worker -> the start requests for it wait on
        self.starting: dict[str, asyncio.Task[None]] = {}
        # worker -> the wait for its first load that requests share
        self.loading: dict[str, asyncio.Task[None]] = {}
        # workers told to unload (until the supervisor says they are idle)
        self.unloading: set[str] = set()
        # worker -> the last exit the supervisor reported
        self.exited: dict[str, WorkerExited] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # worker -> the waits for its next news (_news_of)
        self._news: dict[str, list[asyncio.Future[None]]] = {}
        self.broker.listeners.append(self)

    def on_worker_exited(self, event: WorkerExited) -> None:
        self.exited[event.worker] = event
        self._wake(event.worker)

    def on_heartbeat(self, link: WorkerLink, beat: Heartbeat) -> None:
        self._wake(link.name)

    def on_status(self, status: WorkerStatus) -> None:
        self._wake(status.worker)

    def _wake(self, worker: str) -> None:
        for waiter in self._news.pop(worker, ()):
            if not waiter.done():
                waiter.set_result(None)

    async def _news_of(self, worker: str) -> None:
        """Return at `worker`'s next heartbeat, supervisor status or exit, or after POLL."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._news.setdefault(worker, []).append(waiter)
        try:
            await asyncio.wait_for(waiter, POLL)
        except TimeoutError:
            pass
        finally:
            with contextlib.suppress(ValueError):
                self._news.get(worker, []).remove(waiter)

    def usable(self, link: WorkerLink) -> bool:
        return link.serving and link.name not in self.unloading

    def _lock(self, worker: str) -> asyncio.Lock:
        return self.locks.setdefault(worker, asyncio.Lock())

    # --- starting ------------------------------------------------------------------------

    def sleeper(self, workers: list[str]) -> str | None:
        """The worker to start when none of `workers` serves: an idle one, one being unloaded
        or one already starting (None when one serves, or none can be started here)."""
        links = [self.broker.links[w] for w in workers if w in self.broker.links]
        if any(self.usable(link) for link in links):
            return None
        for link in links:
            if link.name in self.starting or link.name in self.unloading or link.idle:
                return link.name
        return None

    async def ask_states(self) -> None:
        """The supervisor's state of each worker, asked once before the gateway binds.

        NOTE: its published status comes once a second; until then a worker loading at
        start could not be told from one restarting, and /health/ready would say 503."""
        try:
            reply = await asyncio.to_thread(control.call, self.config, control.Status(),
                                            control.StatusReply, 2.0)
        except control.ControlError:
            return  # NOTE: no supervisor answers (yet): its published statuses will come
        for child in reply.children:
            link = self.broker.links.get(child.name)
            if link is not None and link.supervised is None:
                self.broker.on_status(WorkerStatus(
                    worker=child.name, state=child.state, pid=child.pid or 0,
                    restarts=child.restarts, last_error=child.last_error,
                    recovering=child.recovering))

    def unheard(self, link: WorkerLink) -> bool:
        """`link` serves as far as this gateway knows (its supervisor says so, or it is
        another host's worker, which this gateway learns of only from it) but this gateway
        has not heard its current process yet, for less than its heartbeat_timeout since it
        connected to it or the supervisor named that process."""
        beat = link.heartbeat
        if beat is not None and beat.pid == link.pid:
            return False
        sup = link.supervised
        # NOTE: not a worker restarting after a crash (its requests get the 503: see
        # WorkerLink.first_load), nor one that is idle, failed or stopped.
        known = sup.state.serving if sup is not None else not link.idle
        return known and time.monotonic() - link.pid_since < link.spec.heartbeat_timeout

    def first_loading(self, workers: list[str]) -> str | None:
        """The worker of `workers` to wait for when none serves: one loading for the first
        time (WorkerLink.first_load) or after a crash (`reloading`), or one this gateway has
        not heard yet (`unheard`)."""
        links = [self.broker.links[w] for w in workers if w in self.broker.links]
        if any(self.usable(link) for link in links):
            return None
        # NOTE: not a worker being switched to another model (the Switcher waits for those):
        # until its new process reports, the table still lists it under its old model.
        return next((link.name for link in links
                     if (link.first_load or link.reloading or self.unheard(link))
                     and link.name not in self.pending), None)

    async def ready(self, workers: list[str]) -> None:
        """Start one of `workers` if none serves and one is idle, or wait for one loading
        for the first time or not heard yet; return once it serves."""
        name = self.sleeper(workers)
        if name is None:
            loading = self.first_loading(workers)
            if loading is not None:
                await self._wait_first_load(loading)
            return
        task = self.starting.get(name)
        if task is None:
            task = asyncio.ensure_future(self._start(name))
            self.starting[name] = task
            task.add_done_callback(functools.partial(self._started, name))
        # NOTE: shielded: a client that leaves stops waiting, not the start.
        await asyncio.shield(task)

    def _started(self, name: str, task: asyncio.Task[None]) -> None:
        if self.starting.get(name) is task:
            del self.starting[name]
        if not task.cancelled():
            task.exception()  # NOTE: retrieved: a start nobody waits for any more is no error

    async def _start(self, name: str) -> None:
        link = self.broker.links[name]
        spec = link.spec
        async with self._lock(name):
            if self.usable(link):
                return
            old_pid = link.pid
            before = self.exited.get(name)
            began = time.monotonic()
            log.info("starting worker %s: a request needs it", name, extra={"worker": name})
            await ask(self.config, control.Start(worker=name), control.Ok, f"start worker {name}")
            await self._wait_serving(link, spec, old_pid, before)
            self.used_at[name] = time.monotonic()
            log.info("worker %s serves, %.2f s after a request needed it", name,
                     time.monotonic() - began, extra={"worker": name})

    async def _wait_first_load(self, name: str) -> None:
        """Wait for a worker loading for the first time or after a crash to serve, within
        its load_timeout, or for the first heartbeat of one not heard yet, within its
        heartbeat_timeout.

        NOTE: one wait per worker, shared like a start; a crash during a first load ends it
        with a 503, as does a crash loop (failed) during a restart."""
        task = self.loading.get(name)
        if task is None:
            link = self.broker.links[name]
            what = (f"{link.state.label} for the first time" if link.first_load else
                    "restarting after a crash" if link.reloading else
                    f"not heard yet (up to {link.spec.heartbeat_timeout:g} s, heartbeat_timeout)")
            log.info("requests wait for worker %s: %s", name, what, extra={"worker": name})
            task = asyncio.ensure_future(self._wait_first_news(link))
            self.loading[name] = task
            task.add_done_callback(functools.partial(self._loaded, name))
        await asyncio.shield(task)

    async def _wait_first_news(self, link: WorkerLink) -> None:
        before = self.exited.get(link.name)
        while self.unheard(link):
            await self._news_of(link.name)
        if link.serving:
            return
        if link.first_load:
            await self._wait_serving(link, link.spec, 0, before, given_up=_RESTARTING)
            return
        if link.reloading:
            # NOTE: its backoff is waited for too; a crash loop (failed) or another exit
            # meanwhile ends the wait with a 503.
            await self._wait_serving(link, link.spec, 0, before, given_up=_DOWN)
            return
        beat = link.heartbeat
        silent = time.monotonic() - link.pid_since >= link.spec.heartbeat_timeout
        if silent and (beat is None or beat.pid != link.pid):
            # NOTE: the gateway hears a worker on its own reply topic: silence here with a
            # worker its supervisor says serves is a network, key or subscription problem.
            raise unavailable(f"worker {link.name} sent this gateway no heartbeat within "
                              f"{link.spec.heartbeat_timeout:g} s (heartbeat_timeout); is it "
                              "running, reachable and does it accept this gateway's key?",
                              FAILED_START_RETRY)
        # NOTE: heard and not serving, or known down meanwhile: the dispatch's 503 says so.

    def _loaded(self, name: str, task: asyncio.Task[None]) -> None:
        if self.loading.get(name) is task:
            del self.loading[name]
        if not task.cancelled():
            task.exception()  # NOTE: retrieved: every waiter got it through the shield

    async def _wait_serving(self, link: WorkerLink, spec: WorkerSpec, old_pid: int,
                            before: WorkerExited | None,
                            given_up: tuple[ProcessState, ...] = _DOWN) -> None:
        deadline = time.monotonic() + spec.load_timeout + CONTROL_TIMEOUT
        while not link.serving or (old_pid and link.pid == old_pid):
            state = link.state
            sup = link.supervised
            if state in given_up:
                why = (sup.last_error if sup is not None else "") or state.label
                raise unavailable(f"worker {link.name} could not start: {why}",
                                  FAILED_START_RETRY)
            gone = self.exited.get(link.name)
            if gone is not None and gone is not before and gone.pid != old_pid:
                raise unavailable(f"worker {link.name} exited with code {gone.returncode} "
                                  "while starting; see its log", FAILED_START_RETRY)
            if time.monotonic() > deadline:
                raise unavailable(f"worker {link.name} did not load within "
                                  f"{spec.load_timeout:.0f} s (load_timeout)", FAILED_START_RETRY)
            await self._news_of(link.name)

    # --- unloading -----------------------------------------------------------------------

    def keep_for(self, spec: WorkerSpec) -> float | None:
        """Seconds idle before `spec`'s worker is unloaded now (None = never): its keep_alive,
        or the last keep_alive requested for a switched-to model it runs."""
        keep = spec.idle_stop
        if keep is None:
            return None
        table = self.table
        current = table.current_model(spec)
        if current != table.default_model(spec):
            keep = self.keep_alive.get(current, keep)
        return keep

    def reap(self, now: float) -> None:
        """Unload the workers idle past their keep_alive (the Switcher's loop calls it)."""
        for spec in self.config.workers:
            keep = self.keep_for(spec) if spec.enabled else None
            link = self.broker.links.get(spec.name)
            if keep is None or link is None or not link.serving:
                continue
            name = spec.name
            lock = self.locks.get(name)
            if name in self.unloading or name in self.starting or name in \
                    self.pending or (lock is not None and lock.locked()):
                continue
            beat = link.heartbeat
            if link.requests or (beat is not None and (beat.in_flight or beat.queue)):
                self.used_at[name] = now
                continue
            idle = now - self.used_at.setdefault(name, now)
            if idle >= keep:
                # NOTE: marked now, so that a request from here on waits for the next start
                # instead of being routed to a worker about to drain.
                self.unloading.add(name)
                task = asyncio.ensure_future(self._unload(link, idle, keep))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _unload(self, link: WorkerLink, idle: float, keep: float) -> None:
        name = link.name
        try:
            async with self._lock(name):
                if link.requests or not link.serving:
                    return  # NOTE: a request came meanwhile, or it went away by itself
                log.info("unloading worker %s: idle %.1f s (keep_alive %.1f s)", name, idle,
                         keep, extra={"worker": name})
                await ask(self.config, control.Unload(worker=name), control.Ok,
                          f"unload worker {name}")
                # NOTE: the lock is held until the supervisor says the worker is idle, so a
                # request meanwhile starts it after its exit, never routes to it draining.
                deadline = time.monotonic() + self.config.grace_period + CONTROL_TIMEOUT
                while time.monotonic() < deadline and (
                        link.serving or link.state == ProcessState.DRAINING):
                    await self._news_of(name)
        except Exception as exc:
            log.warning("unloading worker %s failed: %s", name, exc, extra={"worker": name})
        finally:
            self.unloading.discard(name)

    def expires_at(self, model: ServedModel) -> float | None:
        """Wall-clock time `model` is unloaded with its workers' keep_alive (None: it is not
        held by such a worker)."""
        table = self.table
        now = time.monotonic()
        left = []
        for worker in model.workers:
            spec = self.config.worker(worker)
            link = self.broker.links.get(worker)
            if spec.idle_stop is None or link is None or not link.serving or \
                    table.current_model(spec) != table.default_model(spec):
                continue
            left.append(spec.idle_stop - (now - self.used_at.get(worker, now)))
        return time.time() + max(0.0, max(left)) if left else None

    async def stop(self) -> None:
        tasks = [*self._tasks, *self.starting.values(), *self.loading.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
