"""Health endpoints: liveness, readiness and the devices/workers overview.

All three read state the gateway already holds (heartbeats, the metrics' worker records);
none of them waits on a worker, so they answer at once even while a worker hangs. A worker's
state is `WorkerLink.state` (the broker decides it), the same name /metrics and
`npx-supervisor status` give.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.metrics import LLM_ROLES, Metrics
from npu_proxy.gateway.core.worker_link import WorkerLink
from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.states import ProcessState


def _describe(link: WorkerLink) -> str:
    state = link.state
    beat = link.heartbeat
    if state == ProcessState.STARTING and beat is None:
        return f"{link.name} has not reported yet"
    if state.serving and not link.serving:
        return f"{link.name} is {state.label}, but this gateway has not heard it say so yet"
    if state == ProcessState.UNRESPONSIVE and beat is not None:
        age = link.heartbeat_age()
        if age >= link.silence_allowed():
            return f"{link.name} sent no heartbeat for {age:.0f} s"
        if beat.stalled_for > link.spec.stall_timeout:
            return f"{link.name} made no progress for {beat.stalled_for:.0f} s"
    return f"{link.name} is {state.label}"


def worker_row(metrics: Metrics, spec: WorkerSpec, link: WorkerLink | None) -> dict[str, Any]:
    """One worker as /health/devices and the status page show it."""
    name = spec.name
    rec = metrics.workers.get(name)
    beat = link.heartbeat if link is not None else None
    age = link.heartbeat_age() if link is not None and link.seen_at else None
    # NOTE: the supervisor's own view (restarts, last error, backoff/failed) outlives a
    # gateway restart; the gateway's records fill in before its first status arrives.
    supervised = link.supervised if link is not None else None
    restarts = rec.restarts if rec is not None else 0
    last_error = rec.last_error if rec is not None else ""
    if supervised is not None:
        restarts = supervised.restarts
        last_error = supervised.last_error or last_error
    # NOTE: a disabled worker has no link; the supervisor holds it stopped.
    state = link.state if link is not None else ProcessState.STOPPED
    if state == ProcessState.IDLE:
        beat = None  # NOTE: not loaded: its last heartbeat was a process that is gone
    return {
        "name": name, "role": spec.role, "device": spec.device, "model": spec.model_name,
        "state": state.label,
        "up": bool(link is not None and link.serving),
        # A process runs for it (idle = not loaded: started by the next request needing it).
        "loaded": state.alive,
        "pid": beat.pid if beat is not None else None,
        "queue": beat.queue if beat is not None else 0,
        "in_flight": beat.in_flight if beat is not None else 0,
        # The gateway's own open requests on this worker (streams it routes frames to).
        "gateway_requests": len(link.requests) if link is not None else 0,
        "served": beat.served if beat is not None else 0,
        "load_seconds": round(beat.load_seconds, 3) if beat is not None else None,
        "restarts": restarts,
        "last_error": last_error,
        "heartbeat_age": round(age, 3) if age is not None else None,
    }


def worker_rows(config: Config, broker: Broker, metrics: Metrics) -> list[dict[str, Any]]:
    """Every configured worker, in the configuration's order (a disabled one is stopped)."""
    return [worker_row(metrics, spec, broker.links.get(spec.name) if spec.enabled else None)
            for spec in config.workers]


class HealthRoutes:
    def __init__(self, config: Config, broker: Broker, metrics: Metrics) -> None:
        self.config = config
        self.broker = broker
        self.metrics = metrics

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health, methods=["GET", "HEAD"]),
            Route("/health/ready", self.ready, methods=["GET", "HEAD"]),
            Route("/health/devices", self.devices, methods=["GET"]),
        ]

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """Can the server take a generation now: an LLM worker serves, is idle (not loaded,
        started by the request) or is loading for the first time (the request waits for
        it, as for an idle one). 503 while none can: failed, restarting, none configured.

        NOTE: a worker serves once this gateway has heard it say so (WorkerLink.serving); one
        its supervisor says serves, or another host's worker, not heard yet is not counted.
        A request waits for that first heartbeat (up to heartbeat_timeout: Residency.unheard),
        but it may never come (a wrong key, a host down), so a balancer is not told to send
        requests here on that hope."""
        llm = [link for link in self.broker.links.values() if link.spec.role in LLM_ROLES]
        serving = [link.name for link in llm if link.serving]
        idle = [link.name for link in llm if link.idle]
        # NOTE: a restart's load is not counted (WorkerLink.first_load): a balancer then
        # sends the requests to an instance that serves.
        loading = [link.name for link in llm if link.first_load]
        if serving or idle or loading:
            return JSONResponse({"status": "ready", "workers": serving, "not_loaded": idle,
                                 "loading": loading})
        if not llm:
            reason = "no LLM worker is configured"
        else:
            reason = "no LLM worker is ready: " + "; ".join(_describe(link) for link in llm)
        return JSONResponse({"status": "not_ready", "reason": reason}, status_code=503,
                            headers={"Retry-After": "5"})

    async def devices(self, request: Request) -> Response:
        workers = worker_rows(self.config, self.broker, self.metrics)
        devices: dict[str, dict[str, Any]] = {
            name: {"device": name, "full_name": full, "workers": [], "up": False}
            for name, full in self.config.devices.items()
        }
        for spec, row in zip(self.config.workers, workers, strict=True):
            dev = devices.setdefault(spec.device, {"device": spec.device,
                                                   "full_name": spec.device,
                                                   "workers": [], "up": False})
            dev["workers"].append(spec.name)
            dev["up"] = dev["up"] or row["up"]
        return JSONResponse({"devices": list(devices.values()), "workers": workers})
