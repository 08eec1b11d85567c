"""A worker speaks only for itself and serves one gateway (issue 27, remote workers).

- Heartbeats are bound to the link they arrive on: one naming another worker is ignored,
  and metric label values come from the gateway's own configuration (a heartbeat cannot add
  series). In process, the broker and metrics against a socket standing in for a worker that
  lies.
- A worker publishes every frame to every subscriber, so a worker host serves one gateway:
  `client_key_files` with a second gateway, or beside this instance's own gateway, is
  refused at start with a message saying why.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import zmq
from serverctl import Server, free_port_block

from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.metrics import Metrics
from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.liveness import EMBED_BATCH_CLASSES, Heartbeat
from npu_proxy.protocol.messages import encode
from npu_proxy.protocol.sockets import TOPIC_HEARTBEAT, bind, configure_pub, worker_endpoint
from npu_proxy.protocol.states import ProcessState


def _beat(worker: str, **fields: object) -> Heartbeat:
    return Heartbeat(worker=worker, pid=os.getpid(), role="embed", device="CPU", model="m",
                     state=ProcessState.READY, **fields)  # type: ignore[arg-type]


def _series(exposition: str, family: str) -> list[str]:
    return [line for line in exposition.splitlines() if line.startswith(family + "{")]


def test_a_heartbeat_speaks_only_for_its_own_link(tmp_path: Path) -> None:
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    config = Config(transport="ipc", runtime_dir=str(runtime),
                    workers=[WorkerSpec(name="embed", role="embed")])
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    configure_pub(pub)
    bind(pub, config, worker_endpoint(config, "embed", "out"))

    async def run() -> None:
        broker = Broker(config)
        metrics = Metrics(config, broker)
        broker.listeners.append(metrics)
        await broker.start()
        try:
            link = broker.links["embed"]
            deadline = time.monotonic() + 30
            while link.heartbeat is None:  # NOTE: until the SUB's subscription arrived
                assert time.monotonic() < deadline, "the broker never heard the worker"
                pub.send_multipart((TOPIC_HEARTBEAT, encode(_beat("embed"))))
                await asyncio.sleep(0.01)
            # The worker on this link names others, with counters and a long batch list.
            for name in ("intruder", "llm", "x" * 200):
                pub.send_multipart((TOPIC_HEARTBEAT, encode(_beat(
                    name, queue=99, cache_hits=50, embed_batches=[1] * 1000))))
            pub.send_multipart((TOPIC_HEARTBEAT, encode(_beat(
                "embed", queue=8, cache_hits=60, embed_batches=[2] * 1000))))
            pub.send_multipart((TOPIC_HEARTBEAT, encode(_beat(
                "embed", queue=7, cache_hits=3, embed_batches=[2] * len(EMBED_BATCH_CLASSES)))))
            while link.heartbeat.queue != 7:  # NOTE: frames of one link arrive in order
                assert time.monotonic() < deadline + 30, "the last heartbeat never arrived"
                await asyncio.sleep(0.01)
            assert link.heartbeat.worker == "embed"
            text = metrics.exposition().decode()
            hits = _series(text, "npu_proxy_embedding_cache_hits_total")
            assert hits == ['npu_proxy_embedding_cache_hits_total{worker="embed"} 3.0']
            assert "intruder" not in text and "x" * 200 not in text
            batches = _series(text, "npu_proxy_embedding_batches_total")
            assert batches and all('worker="embed"' in s for s in batches)
            assert len(batches) == len(EMBED_BATCH_CLASSES)
        finally:
            await broker.stop()

    try:
        asyncio.run(run())
    finally:
        pub.close(0)
        ctx.term()


def _refused(tmp: Path, args: list[str], **settings: object) -> str:
    server = Server(tmp, workers=[{"name": "far", "role": "llm"}], transport="tcp",
                    tcp_base_port=free_port_block(4), **settings)
    server.cli("keys")
    try:
        server.start(wait=False, args=args)
        assert server.proc is not None
        assert server.proc.wait(120) != 0
        return server.logs()
    finally:
        server.stop()


def test_a_worker_host_serves_one_gateway(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    other = Server(keys, workers=[])
    other.cli("keys")
    key = str(Path(other.config.keys_path()) / "client.key")
    logs = _refused(tmp_path / "two", ["--worker-only"], client_key_files=[key, key])
    assert "client_key_files lists 2 gateways; a worker serves one gateway" in logs
    logs = _refused(tmp_path / "beside", [], client_key_files=[key])
    assert "Start the workers for another host with --worker-only" in logs
