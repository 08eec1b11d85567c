"""Metrics, health and logs, read the way operators read them: /metrics parsed with
prometheus-client's own parser before and after real requests, a real Prometheus scraping
the gateway, health endpoints while a worker loads, hangs or is killed, and one request
followed through the gateway's and the worker's logs by its id.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serverctl import Server, free_port, small_llm, stop_process, wait_for

from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.metrics import Metrics
from npu_proxy.gateway.http.wire import api_label
from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.liveness import Heartbeat, WorkerExited
from npu_proxy.protocol.states import ProcessState

LLM = "smollm2:135m"
DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
# NOTE: asks for far more text than max_tokens allows, so the answer stops at the limit.
LONG_ASK = [{"role": "user", "content": "Write a very long story about a dragon who learns "
                                        "to bake bread. Use at least 600 words."}]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    r = httpx.get(url + "/metrics", timeout=5)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when there are none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)



def delta_reaches(url: str, before: Samples, name: str, amount: float,
                  timeout: float = 10.0, **labels: str) -> Samples:
    """Scrape until `name` grew by at least `amount`; returns that scrape."""
    base = value(before, name, **labels)

    def grown() -> Samples | None:
        now = scrape(url)
        return now if value(now, name, **labels) - base >= amount else None

    result: Samples = wait_for(grown, timeout)
    return result


# --- metrics from real requests (the shared server) --------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_generation_metrics_move_by_the_right_amount(base_url: str, stream: bool) -> None:
    n = 12
    labels = {"worker": "llm", "device": "CPU", "model": LLM}
    before = scrape(base_url)
    body = {"model": LLM, "messages": LONG_ASK, "max_tokens": n, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=body,
                          timeout=120) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        usage = events[-1]["usage"]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    else:
        r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200
        usage = r.json()["usage"]
        assert r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens"] == n
    endpoint = {"endpoint": "/v1/chat/completions", "api": "openai"}
    after = delta_reaches(base_url, before, "npu_proxy_requests_total", 1,
                          endpoint="/v1/chat/completions", api="openai", status="200")

    def grew(name: str, **ls: str) -> float:
        return value(after, name, **ls) - value(before, name, **ls)

    assert grew("npu_proxy_tokens_generated_total", **labels) == n
    assert grew("npu_proxy_tokens_generated_total") == n
    assert grew("npu_proxy_prompt_tokens_total", **labels) == usage["prompt_tokens"]
    assert grew("npu_proxy_time_to_first_token_seconds_count", **labels) == 1
    assert 0 < grew("npu_proxy_time_to_first_token_seconds_sum", **labels) < 120
    # One observation per token after the first frame (a frame may carry several tokens).
    assert 1 <= grew("npu_proxy_inter_token_latency_seconds_count", **labels) <= n - 1
    assert grew("npu_proxy_inference_duration_seconds_count", **labels) == 1
    assert grew("npu_proxy_requests_total", **endpoint, status="200") == 1
    assert grew("npu_proxy_request_duration_seconds_count", **endpoint) == 1
    assert grew("npu_proxy_route_decisions_total", worker="llm", reason="preferred") == 1


def test_error_status_and_unmatched_paths_are_counted(base_url: str) -> None:
    before = scrape(base_url)
    r = httpx.post(base_url + "/v1/chat/completions",
                   json={"model": "no-such-model", "messages": LONG_ASK}, timeout=10)
    assert r.status_code == 404
    assert httpx.get(base_url + "/no/such/path/" + uuid.uuid4().hex, timeout=10).status_code \
        == 404
    after = delta_reaches(base_url, before, "npu_proxy_requests_total", 1,
                          endpoint="unmatched", api="other", status="404")
    assert value(after, "npu_proxy_requests_total", endpoint="/v1/chat/completions",
                 api="openai", status="404") - value(
        before, "npu_proxy_requests_total", endpoint="/v1/chat/completions", api="openai",
        status="404") == 1
    assert value(after, "npu_proxy_route_decisions_total") == value(
        before, "npu_proxy_route_decisions_total")


def test_embedding_cache_hit_is_counted(base_url: str) -> None:
    text = f"observability cache probe {uuid.uuid4().hex}"
    before = scrape(base_url)
    for _ in range(2):
        r = httpx.post(base_url + "/v1/embeddings",
                       json={"model": "all-minilm:l6-v2", "input": text}, timeout=60)
        assert r.status_code == 200, r.text
    # NOTE: cache counters travel in heartbeats (every 0.5 s), so they arrive a little later.
    after = delta_reaches(base_url, before, "npu_proxy_embedding_cache_hits_total", 1,
                          worker="embed")
    after = delta_reaches(base_url, before, "npu_proxy_embedding_cache_misses_total", 1,
                          worker="embed")
    hits = value(after, "npu_proxy_embedding_cache_hits_total", worker="embed") - value(
        before, "npu_proxy_embedding_cache_hits_total", worker="embed")
    misses = value(after, "npu_proxy_embedding_cache_misses_total", worker="embed") - value(
        before, "npu_proxy_embedding_cache_misses_total", worker="embed")
    assert (hits, misses) == (1, 1)
    assert value(after, "npu_proxy_requests_total", endpoint="/v1/embeddings", api="openai",
                 status="200") - value(before, "npu_proxy_requests_total",
                                       endpoint="/v1/embeddings", api="openai",
                                       status="200") == 2


def test_worker_gauges_and_health_on_a_ready_server(server: Server) -> None:
    samples = scrape(server.url)
    for name, role in (("llm", "llm"), ("embed", "embed"), ("rerank", "rerank")):
        assert value(samples, "npu_proxy_worker_up", worker=name, role=role,
                     device="CPU") == 1
        states = {dict(ls)["state"]: v for (n, ls), v in samples.items()
                  if n == "npu_proxy_worker_state" and ("worker", name) in ls}
        assert set(states) == {s.label for s in ProcessState}
        assert sum(states.values()) == 1 and (states["ready"] or states["busy"])
        assert ("npu_proxy_queue_depth", frozenset({("worker", name)})) in samples
        assert ("npu_proxy_in_flight_requests", frozenset({("worker", name)})) in samples
        assert value(samples, "npu_proxy_model_load_seconds_count", worker=name) >= 1
    assert value(samples, "npu_proxy_loaded_models") == 3
    ready = httpx.get(server.url + "/health/ready", timeout=5)
    assert ready.status_code == 200 and ready.json()["workers"] == ["llm"]
    info = httpx.get(server.url + "/health/devices", timeout=5).json()
    [cpu] = info["devices"]
    assert cpu.pop("full_name")  # the name OpenVINO reports for the device found at start
    assert cpu == {"device": "CPU", "workers": ["llm", "embed", "rerank"], "up": True}
    kids = server.children()
    rows = {w["name"]: w for w in info["workers"]}
    assert set(rows) == {"llm", "embed", "rerank"}
    for name, row in rows.items():
        assert row["role"] == kids[name]["role"] and row["device"] == "CPU"
        assert row["model"] == kids[name]["model"]
        assert row["pid"] == kids[name]["pid"]
        assert row["state"] in ("ready", "busy") and row["up"] is True
        assert isinstance(row["restarts"], int) and isinstance(row["last_error"], str)
        assert 0 <= row["heartbeat_age"] < 5
        assert isinstance(row["queue"], int) and isinstance(row["in_flight"], int)


def test_one_request_is_found_in_both_logs_by_its_id(server: Server) -> None:
    rid = "obs-" + uuid.uuid4().hex
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   headers={"x-request-id": rid},
                   json={"model": LLM, "messages": LONG_ASK, "max_tokens": 3})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid

    def lines(name: str) -> list[str]:
        return [line for line in server.worker_log(name).splitlines() if rid in line]

    gateway = wait_for(lambda: lines("gateway"), 5)
    worker = wait_for(lambda: lines("llm"), 5)
    assert any("POST /v1/chat/completions 200" in line and f"request_id={rid}" in line
               and "worker=llm" in line and "device=CPU" in line for line in gateway), gateway
    assert any(f"request_id={rid} " in line and "worker=llm" in line and "device=CPU" in line
               for line in worker), worker
    # The other worker never saw it.
    assert not lines("embed")


# --- health and restarts on private servers ----------------------------------------------


def test_ready_flips_and_a_killed_worker_restarts(tmp_path: Path) -> None:
    # NOTE: the small model (serverctl.small_llm) on both private servers: they test health,
    # states and restarts, and load the model twice (here) or at the stop (the hung load).
    srv = Server(tmp_path, workers=[{"name": "llm", "role": "llm"}],
                 models=small_llm()).start(wait=False)
    try:
        srv.wait_http(60)
        seen: list[int] = []

        def ready() -> bool:
            r = httpx.get(srv.url + "/health/ready", timeout=10)
            if not seen or seen[-1] != r.status_code:
                seen.append(r.status_code)
            if r.status_code == 503:
                assert "llm" in r.json()["reason"]
            return r.status_code == 200

        wait_for(ready, 240, every=0.05)
        # NOTE: 200 from the first answer: the worker loading at start can serve (a request
        # waits for it); its restart below is a 503.
        assert seen == [200]
        srv.wait_ready(60)
        before = scrape(srv.url)
        assert value(before, "npu_proxy_worker_up", worker="llm") == 1
        assert value(before, "npu_proxy_worker_restarts_total") == 0
        pid = srv.children()["llm"]["pid"]
        os.kill(pid, signal.SIGKILL)

        def up_is(expected: float) -> Samples | None:
            now = scrape(srv.url)
            return now if value(now, "npu_proxy_worker_up", worker="llm") == expected else None

        down = wait_for(lambda: up_is(0), 30, every=0.05)
        assert value(down, "npu_proxy_worker_state", worker="llm", state="ready") == 0
        assert httpx.get(srv.url + "/health/ready", timeout=10).status_code == 503
        # NOTE: up follows the supervisor's status, the load time the worker's own heartbeat
        # (another socket): the second load is counted once that heartbeat has arrived.
        def reloaded() -> Samples | None:
            now = up_is(1)
            loads = value(now, "npu_proxy_model_load_seconds_count", worker="llm") if now else 0
            return now if loads == 2 else None

        up = wait_for(reloaded, 240, every=0.2)
        assert value(up, "npu_proxy_worker_restarts_total", worker="llm", reason="sigkill") == 1
        assert value(up, "npu_proxy_worker_restarts_total") == 1
        assert httpx.get(srv.url + "/health/ready", timeout=10).status_code == 200
        row = httpx.get(srv.url + "/health/devices", timeout=5).json()["workers"][0]
        assert row["restarts"] == 1 and row["pid"] != pid
        assert "-9" in row["last_error"]
    finally:
        srv.stop()


def test_health_answers_while_the_worker_hangs_in_load(tmp_path: Path) -> None:
    srv = Server(tmp_path, workers=[{"name": "llm", "role": "llm", "load_timeout": 600.0,
                                     "faults": {"hang_in_load": True}}],
                 models=small_llm()).start(wait=False)
    try:
        srv.wait_http(60)
        srv.wait_state("llm", ("loading",), 60)
        wait_for(lambda: "fault hook: hanging in load" in srv.worker_log("llm"), 30)
        wait_for(lambda: httpx.get(srv.url + "/health/devices", timeout=10).json()[
            "workers"][0]["state"] == "loading", 10)
        with httpx.Client(base_url=srv.url, timeout=10) as client:
            for _ in range(20):
                assert client.get("/health").json() == {"status": "ok"}
                # A first load (within its load_timeout) can serve: requests wait for it.
                r = client.get("/health/ready")
                assert r.status_code == 200
                assert r.json()["loading"] == ["llm"] and r.json()["workers"] == []
                time.sleep(0.05)
            row = client.get("/health/devices").json()["workers"][0]
            assert row["state"] == "loading" and row["up"] is False
            samples = scrape(srv.url)
        assert value(samples, "npu_proxy_worker_state", worker="llm", state="loading") == 1
        assert value(samples, "npu_proxy_worker_up", worker="llm") == 0
        assert value(samples, "npu_proxy_loaded_models") == 0
    finally:
        srv.stop()


# --- a real Prometheus -------------------------------------------------------------------


def _prometheus_config(target: str, tmp: Path, credentials: str = "") -> Path:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    (job,) = config["scrape_configs"]
    job["scrape_interval"] = "1s"
    job["scrape_timeout"] = "1s"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:11435"]
    job["static_configs"][0]["targets"] = [target]
    if credentials:
        # NOTE: what deploy/prometheus.yml says to add when an API key is set.
        job["authorization"] = {"credentials": credentials}
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def running_prometheus(server: Server, tmp_path: Path, credentials: str = "") -> Iterator[str]:
    """A real Prometheus scraping `server` with deploy/prometheus.yml; yields its URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no `prometheus` binary on PATH (Debian package `prometheus`; "
                    ".ci/run installs it)")
    port = free_port()
    config = _prometheus_config(f"127.0.0.1:{server.port}", tmp_path, credentials)
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        def started() -> bool:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                return httpx.get(url + "/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(started, 60, every=0.2)
        yield url
    finally:
        stop_process(proc)
        log.close()


@pytest.fixture
def prometheus(server: Server, tmp_path: Path) -> Iterator[str]:
    with running_prometheus(server, tmp_path) as url:
        yield url


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=5)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def test_real_prometheus_scrapes_the_gateway(server: Server, prometheus: str) -> None:
    def scraped() -> bool:
        up = query(prometheus, 'up{job="npu-proxy"}')
        return bool(up) and up[0]["value"][1] == "1"

    wait_for(scraped, 30, every=0.3)
    # NOTE: a label value no other test uses, so the count is the test's own.
    endpoint = '{endpoint="/v1/models/{model_id:path}",api="openai",status="404"}'
    expr = f"sum(npu_proxy_requests_total{endpoint}) or vector(0)"
    start = float(query(prometheus, expr)[0]["value"][1])
    for _ in range(3):
        assert httpx.get(server.url + "/v1/models/obs-missing-model", timeout=5).status_code \
            == 404

    def counted() -> bool:
        return float(query(prometheus, expr)[0]["value"][1]) == start + 3

    wait_for(counted, 30, every=0.3)
    up = query(prometheus, 'npu_proxy_worker_up{worker="llm"}')
    assert up and up[0]["value"][1] == "1" and up[0]["metric"]["device"] == "CPU"
    # Every query of the Grafana dashboard is valid PromQL and finds its series.
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            query(prometheus, target["expr"].replace("$__rate_interval", "1m"))


# --- restart bookkeeping, in process -----------------------------------------------------


def _beat(pid: int, hits: int = 0, state: ProcessState = ProcessState.READY) -> Heartbeat:
    return Heartbeat(worker="embed", pid=pid, role="embed", device="CPU", model="m",
                     state=state, cache_hits=hits, load_seconds=1.0)


def test_restart_and_cache_counters_follow_process_incarnations() -> None:
    config = Config(workers=[WorkerSpec(name="embed", role="embed")])
    broker = Broker(config)
    try:
        metrics = Metrics(config, broker)
        reg = metrics.registry
        link = SimpleNamespace(name="embed")  # NOTE: labels come from the link, not the beat

        def restarts(reason: str) -> float:
            return reg.get_sample_value("npu_proxy_worker_restarts_total",
                                        {"worker": "embed", "reason": reason}) or 0.0

        def hits() -> float:
            return reg.get_sample_value("npu_proxy_embedding_cache_hits_total",
                                        {"worker": "embed"}) or 0.0

        metrics.on_heartbeat(link, _beat(100, hits=3))
        metrics.on_heartbeat(link, _beat(100, hits=5))
        assert hits() == 5
        metrics.on_worker_exited(WorkerExited(worker="embed", pid=100, returncode=-9))
        # The new process counts from zero again.
        metrics.on_heartbeat(link, _beat(200, hits=2))
        assert hits() == 7 and restarts("sigkill") == 1
        # A late frame of the dead process changes nothing.
        metrics.on_heartbeat(link, _beat(100, hits=9))
        metrics.on_worker_exited(WorkerExited(worker="embed", pid=100, returncode=-9))
        assert hits() == 7 and restarts("sigkill") == 1
        # A process that fails in load and one that dies before its first heartbeat.
        metrics.on_heartbeat(link, _beat(200, state=ProcessState.FAILED))
        metrics.on_worker_exited(WorkerExited(worker="embed", pid=200, returncode=1))
        metrics.on_worker_exited(WorkerExited(worker="embed", pid=300, returncode=1))
        metrics.on_heartbeat(link, _beat(400))
        assert restarts("failed") == 1 and restarts("crashed") == 1
        # A successor seen before its predecessor's exit event: counted once, as unknown.
        metrics.on_heartbeat(link, _beat(500))
        metrics.on_worker_exited(WorkerExited(worker="embed", pid=400, returncode=0))
        assert restarts("unknown") == 1
        assert metrics.workers["embed"].restarts == 4
        # Loads seen: pids 100, 200, 400 and 500 (300 never reported).
        assert reg.get_sample_value("npu_proxy_model_load_seconds_count",
                                    {"worker": "embed"}) == 4
    finally:
        broker.ctx.term()


def test_api_labels() -> None:
    """The metrics' api label is the dialect the error shapes use (one decision)."""
    def api_of(path: str) -> str:
        return api_label({"type": "http", "path": path, "headers": []})

    assert api_of("/v1/chat/completions") == "openai"
    assert api_of("/v1/messages") == "anthropic"
    assert api_of("/v1/messages/count_tokens") == "anthropic"
    assert api_of("/v1/responses") == "responses"
    assert api_of("/tokenize") == "openai" and api_of("/v2/rerank") == "openai"
    assert api_of("/api/chat") == "ollama" and api_of("/") == "ollama"
    assert api_of("/metrics") == "other" and api_of("/health/ready") == "other"
