"""Prometheus metrics of the gateway: one private registry, served at /metrics.

Three sources feed it: the HTTP middleware (requests, latency, one access log line per
request), the router's generations (routing decisions, tokens, TTFT, inter-token latency)
and the workers' heartbeats (restarts, load time, embedding cache counters). Gauges that
describe a worker now (up, state, queue, in-flight) are read from the broker at scrape time,
so they are never staler than the last heartbeat.
"""

from __future__ import annotations

import functools
import logging
import signal
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.generation import Generation
from npu_proxy.gateway.core.recent import Recent
from npu_proxy.protocol.config import Config
from npu_proxy.protocol.liveness import Heartbeat, WorkerExited, embed_batch_label
from npu_proxy.protocol.states import ProcessState

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., None])

# NOTE: NPU figures (the specification's table): a cold compile takes 80-220 s, a request
# several seconds, a token 0.1-0.5 s; CPU/GPU are faster. Buckets cover both.
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 180, 300, 600)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
LOAD_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 90, 120, 180, 240, 300, 450, 600, 900)

LLM_ROLES = ("llm", "npu", "vlm")
# Roles whose work is measured in seconds of audio (heard by asr, spoken by tts), not tokens.
SPEECH_ROLES = ("asr", "tts")


def exit_reason(returncode: int) -> str:
    """A short, bounded label for why a worker process ended."""
    if returncode == 0:
        return "exited"
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name.lower()
        except ValueError:
            return "signal"
    return "crashed"


def _guarded(method: F) -> F:
    """A metrics bug must never break the broker's reader task or a request."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            method(*args, **kwargs)
        except Exception:
            log.exception("metrics hook %s failed", method.__name__)

    return wrapper  # type: ignore[return-value]


@dataclass
class WorkerRecord:
    """What the gateway has learnt about one worker across its process incarnations."""

    pid: int = 0
    restarts: int = 0
    last_error: str = ""
    # How the current process ended, once it has; the label of the next restart.
    exit_reason: str = ""
    previous_pids: deque[int] = field(default_factory=lambda: deque(maxlen=32))
    cache_hits: int = 0
    cache_misses: int = 0
    # Embedding pipeline calls per size class, as the current process last reported them.
    embed_batches: list[int] = field(default_factory=list)
    load_observed: bool = False


class _WorkerGauges(Collector):
    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("npu_proxy_worker_up",
                               "1 while the worker serves requests (ready or busy, heartbeats "
                               "fresh), else 0", labels=["worker", "role", "device"])
        state = GaugeMetricFamily("npu_proxy_worker_state",
                                  "1 for the worker's current life-cycle state",
                                  labels=["worker", "role", "device", "state"])
        queue = GaugeMetricFamily("npu_proxy_queue_depth",
                                  "Requests waiting in the worker's queue", labels=["worker"])
        in_flight = GaugeMetricFamily("npu_proxy_in_flight_requests",
                                      "Requests the worker is running", labels=["worker"])
        age = GaugeMetricFamily("npu_proxy_worker_heartbeat_age_seconds",
                                "Seconds since the worker's last heartbeat", labels=["worker"])
        loaded = GaugeMetricFamily("npu_proxy_loaded_models",
                                   "Distinct models loaded on a serving worker")
        models: set[str] = set()
        for link in self.broker.links.values():
            spec = link.spec
            serving = link.serving
            up.add_metric([spec.name, spec.role, spec.device], 1.0 if serving else 0.0)
            # NOTE: link.state, like /health/devices; every state gets a sample (0 or 1).
            current = link.state
            for s in ProcessState:
                state.add_metric([spec.name, spec.role, spec.device, s.label],
                                 1.0 if s == current else 0.0)
            beat = link.heartbeat
            queue.add_metric([spec.name], float(beat.queue if beat and serving else 0))
            in_flight.add_metric([spec.name], float(beat.in_flight if beat and serving else 0))
            if link.seen_at:
                age.add_metric([spec.name], link.heartbeat_age())
            if serving:
                models.add(spec.model_name)
        loaded.add_metric([], float(len(models)))
        return [up, state, queue, in_flight, age, loaded]


class Metrics:
    """The gateway's registry and the hooks that feed it (broker listener, router observer)."""

    def __init__(self, config: Config, broker: Broker) -> None:
        self.config = config
        self.broker = broker
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "npu_proxy_requests_total", "HTTP requests by route, API and status",
            ["endpoint", "api", "status"], registry=reg)
        self.request_duration = Histogram(
            "npu_proxy_request_duration_seconds",
            "HTTP request time until the last byte of the response",
            ["endpoint", "api"], buckets=REQUEST_BUCKETS, registry=reg)
        gen_labels = ["worker", "device", "model"]
        self.inference_duration = Histogram(
            "npu_proxy_inference_duration_seconds",
            "Generation time from dispatch to the worker's final frame",
            gen_labels, buckets=REQUEST_BUCKETS, registry=reg)
        self.ttft = Histogram(
            "npu_proxy_time_to_first_token_seconds",
            "Time from dispatch to the first generated text", gen_labels,
            buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram(
            "npu_proxy_inter_token_latency_seconds",
            "Time between generated tokens, as the gateway receives them", gen_labels,
            buckets=ITL_BUCKETS, registry=reg)
        self.prompt_tokens = Counter(
            "npu_proxy_prompt_tokens_total", "Prompt tokens of generations", gen_labels,
            registry=reg)
        self.generated_tokens = Counter(
            "npu_proxy_tokens_generated_total", "Tokens generated", gen_labels, registry=reg)
        self.route_decisions = Counter(
            "npu_proxy_route_decisions_total", "Requests routed to a worker, by reason",
            ["worker", "reason"], registry=reg)
        self.restarts = Counter(
            "npu_proxy_worker_restarts_total",
            "Worker processes replaced by a new one, by how the previous one ended",
            ["worker", "reason"], registry=reg)
        self.resumptions = Counter(
            "npu_proxy_stream_resumptions_total",
            "Generations sent again after their worker died, from the tokens already sent",
            ["worker"], registry=reg)
        self.load_time = Histogram(
            "npu_proxy_model_load_seconds",
            "Time from worker start until its model was loaded and warmed up",
            ["worker"], buckets=LOAD_BUCKETS, registry=reg)
        self.cache_hits = Counter(
            "npu_proxy_embedding_cache_hits_total", "Embedding inputs served from the cache",
            ["worker"], registry=reg)
        self.cache_misses = Counter(
            "npu_proxy_embedding_cache_misses_total", "Embedding inputs computed by the model",
            ["worker"], registry=reg)
        self.audio_seconds = Counter(
            "npu_proxy_audio_seconds_total",
            "Seconds of audio transcribed (asr workers) or synthesized (tts workers)",
            gen_labels, registry=reg)
        self.embed_batches = Counter(
            "npu_proxy_embedding_batches_total",
            "Embedding pipeline calls, by how many texts each embedded (size class): "
            "concurrent requests batched together make fewer, larger calls",
            ["worker", "size"], registry=reg)
        reg.register(_WorkerGauges(broker))
        # NOTE: the status page's last minutes, fed by the same hooks as the families above.
        self.recent = Recent()
        self.workers: dict[str, WorkerRecord] = {}
        # request id -> (worker, device) of its last route, for the access log line.
        self._routes: OrderedDict[str, tuple[str, str]] = OrderedDict()
        # (worker, device, model) -> that generation's token series (`_token_series`).
        self._series: dict[tuple[str, str, str], tuple[Any, Any, Any]] = {}
        for spec in config.workers:
            if not spec.enabled:
                continue
            self.workers[spec.name] = WorkerRecord()
            if spec.role in LLM_ROLES:
                labels = (spec.name, spec.device, spec.model_name)
                self.prompt_tokens.labels(*labels)
                self.generated_tokens.labels(*labels)
            elif spec.role in SPEECH_ROLES:
                self.audio_seconds.labels(spec.name, spec.device, spec.model_name)
            elif spec.role == "embed":
                # NOTE: only the embedding engine has a cache (workers/embed_engine.py).
                self.cache_hits.labels(spec.name)
                self.cache_misses.labels(spec.name)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def endpoint(self, request: Request) -> Response:
        return Response(self.exposition(), media_type=CONTENT_TYPE_LATEST)

    def record(self, name: str) -> WorkerRecord:
        return self.workers.setdefault(name, WorkerRecord())

    # --- broker listener -----------------------------------------------------------------

    @_guarded
    def on_heartbeat(self, link: Any, beat: Heartbeat) -> None:
        name: str = link.name  # NOTE: labels from the gateway's configuration, not the frames
        rec = self.record(name)
        if beat.pid != rec.pid:
            if beat.pid in rec.previous_pids:
                return  # a late frame from a process already replaced
            self._new_process(name, rec, beat.pid)
        if beat.cache_hits > rec.cache_hits:
            self.cache_hits.labels(name).inc(beat.cache_hits - rec.cache_hits)
            rec.cache_hits = beat.cache_hits
        if beat.cache_misses > rec.cache_misses:
            self.cache_misses.labels(name).inc(beat.cache_misses - rec.cache_misses)
            rec.cache_misses = beat.cache_misses
        if beat.embed_batches:
            self._count_batches(name, rec, beat.embed_batches)
        if not rec.load_observed and beat.load_seconds > 0:
            rec.load_observed = True
            self.load_time.labels(name).observe(beat.load_seconds)
        if beat.error and beat.error != rec.last_error:
            rec.last_error = beat.error
            self.recent.error(name, beat.error)
        if beat.state == ProcessState.FAILED and not rec.exit_reason:
            rec.exit_reason = "failed"

    def _count_batches(self, worker: str, rec: WorkerRecord, counts: list[int]) -> None:
        seen = rec.embed_batches + [0] * (len(counts) - len(rec.embed_batches))
        for i, (now, before) in enumerate(zip(counts, seen, strict=False)):
            if now > before:
                self.embed_batches.labels(worker, embed_batch_label(i)).inc(now - before)
        rec.embed_batches = [max(a, b) for a, b in zip(counts, seen, strict=False)]

    @_guarded
    def on_worker_exited(self, event: WorkerExited) -> None:
        rec = self.record(event.worker)
        if event.pid in rec.previous_pids:
            return  # NOTE: its successor already reported; the restart was counted then.
        if event.pid != rec.pid:
            # A process that died before its first heartbeat reached us.
            self._new_process(event.worker, rec, event.pid)
        reason = "failed" if rec.exit_reason == "failed" else exit_reason(event.returncode)
        # NOTE: unloaded for idling (said idle before the exit): its next process no restart.
        rec.exit_reason = reason = "unloaded" if self.broker.idle(event.worker) else reason
        if event.returncode != 0:
            rec.last_error = f"pid {event.pid} exited with code {event.returncode} ({reason})"
            self.recent.error(event.worker, rec.last_error)

    def _new_process(self, worker: str, rec: WorkerRecord, pid: int) -> None:
        """A restart is a new process; its label says how the one before it ended."""
        if rec.pid:
            rec.previous_pids.append(rec.pid)
        if rec.pid and (reason := rec.exit_reason or "unknown") != "unloaded":
            rec.restarts += 1
            self.restarts.labels(worker, reason).inc()
            log.info("worker %s restarted as pid %d (the previous process: %s)", worker, pid,
                     reason, extra={"worker": worker})
        # NOTE: the counters in a heartbeat are cumulative per process: a new process
        # starts them again from zero.
        rec.pid = pid
        rec.exit_reason = ""
        rec.cache_hits = rec.cache_misses = 0
        rec.embed_batches = []
        rec.load_observed = False

    # --- router observer -----------------------------------------------------------------

    @_guarded
    def on_route(self, request_id: str, worker: str, reason: str) -> None:
        self.route_decisions.labels(worker, reason).inc()
        link = self.broker.links.get(worker)
        self._routes[request_id] = (worker, link.spec.device if link else "")
        self._routes.move_to_end(request_id)
        while len(self._routes) > 4096:
            self._routes.popitem(last=False)

    def _labels(self, gen: Generation) -> tuple[str, str, str]:
        spec = link.spec if (link := self.broker.links.get(gen.stream.worker)) else None
        return gen.stream.worker, spec.device if spec else "", spec.model_name if spec else ""

    def _token_series(self, gen: Generation) -> tuple[Any, Any, Any]:
        """The tokens counter, TTFT and inter-token histograms of a generation's labels.

        NOTE: looked up once per label set, not per token: `labels()` takes a lock and
        builds a key on every call, a cost paid per streamed token (bench/gateway_cpu.py)."""
        labels = self._labels(gen)
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = (self.generated_tokens.labels(*labels),
                                             self.ttft.labels(*labels), self.itl.labels(*labels))
        return series

    @_guarded
    def on_tokens(self, gen: Generation, new: int, gap: float, first: bool) -> None:
        generated, ttft, itl = self._token_series(gen)
        generated.inc(new)
        self.recent.tokens(new)
        if first:
            ttft.observe(gap)
            return
        # NOTE: a frame may carry several tokens (the worker coalesces when the gateway is
        # slower); each gets an equal share of the gap.
        share = gap / new
        for _ in range(new):
            itl.observe(share)

    @_guarded
    def on_done(self, gen: Generation) -> None:
        labels = self._labels(gen)
        fin = gen.finished
        prompt = fin.prompt_tokens if fin is not None else gen.accepted.prompt_tokens
        self.prompt_tokens.labels(*labels).inc(prompt)
        if fin is not None:
            self.inference_duration.labels(*labels).observe(time.monotonic() - gen.started)
        first = gen.first_token_at
        self.recent.finished(gen.stream.worker,
                             first - gen.started if first is not None else None, gen.tokens)

    @_guarded
    def on_resume(self, gen: Generation) -> None:
        self.resumptions.labels(gen.stream.worker).inc()

    @_guarded
    def on_audio(self, worker: str, seconds: float) -> None:
        link = self.broker.links.get(worker)
        if link is not None and seconds > 0:
            self.audio_seconds.labels(worker, link.spec.device, link.spec.model_name).inc(seconds)

    def route_of(self, request_id: str) -> tuple[str, str] | None:
        return self._routes.pop(request_id, None)
