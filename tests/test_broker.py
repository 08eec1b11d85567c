"""The gateway's ZeroMQ side, in process, against sockets standing in for a worker."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import zmq
from fakeworker import LOCAL, until_heard, worker_sockets

from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.worker_link import WorkerUnavailable
from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.liveness import Heartbeat
from npu_proxy.protocol.messages import Delta, Embed, Failed, Finished, encode
from npu_proxy.protocol.states import ProcessState
from npu_proxy.protocol.timings import Timings


def _config(tmp_path: Path) -> Config:
    # NOTE: ipc sockets in a short private folder (their paths have a length limit).
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    return Config(transport="ipc", runtime_dir=str(runtime),
                  workers=[WorkerSpec(name="embed", role="embed")])


def _embed(rid: str) -> Embed:
    return Embed(id=rid, model="m", texts=["x"], deadline=time.time() + 60)


def test_a_request_for_a_worker_nobody_listens_for_fails_at_once(tmp_path: Path) -> None:
    """No worker process bound its socket: open() says so (the router then tries the next
    worker or answers 503) instead of leaving the request waiting for a reply."""
    config = _config(tmp_path)

    async def run() -> None:
        broker = Broker(config)
        await broker.start()
        try:
            with pytest.raises(WorkerUnavailable):
                broker.open("embed", "r1", _embed("r1"))
            assert broker.links["embed"].requests == {}
        finally:
            await broker.stop()

    asyncio.run(run())


def test_frames_arriving_together_reach_each_stream_in_order(tmp_path: Path) -> None:
    """Frames of several requests queued at once (a batch's answers, tokens that came while
    the gateway was busy) are taken in one go and each reaches its own stream, in order."""
    config = _config(tmp_path)
    ctx = zmq.Context()
    pull, pub = worker_sockets(ctx, config, "embed")
    beat = Heartbeat(worker="embed", pid=os.getpid(), role="embed", device="CPU", model="m",
                     state=ProcessState.READY)

    async def run() -> None:
        broker = Broker(config)
        await broker.start()
        try:
            link = broker.links["embed"]
            await until_heard(link, pub, beat)
            streams = {rid: broker.open("embed", rid, _embed(rid)) for rid in ("a", "b", "c")}
            for _ in streams:
                # NOTE: each request reached the worker's side.
                assert pull.poll(30_000) and pull.recv()
            for seq in range(100):
                for rid in streams:
                    pub.send_multipart((LOCAL, encode(
                        Delta(id=rid, seq=seq, text=f"{rid}{seq} ", tokens=seq + 1))))
            # NOTE: one stray frame of a request nobody waits for changes nothing.
            pub.send_multipart((LOCAL, encode(Delta(id="gone", seq=0, text="x",
                                                             tokens=1))))
            for rid in streams:
                pub.send_multipart((LOCAL, encode(
                    Finished(id=rid, seq=100, finish_reason="stop", prompt_tokens=1,
                             completion_tokens=100, timings=Timings()))))
            for rid, stream in streams.items():
                texts = []
                while True:
                    frame = await stream.next_frame(30)
                    assert not isinstance(frame, Failed), frame
                    if isinstance(frame, Finished):
                        break
                    assert isinstance(frame, Delta)
                    texts.append(frame.text)
                assert texts == [f"{rid}{seq} " for seq in range(100)]
        finally:
            await broker.stop()

    try:
        asyncio.run(run())
    finally:
        pull.close(0)
        pub.close(0)
        ctx.term()
