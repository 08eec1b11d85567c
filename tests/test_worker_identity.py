"""A worker speaks only for itself, and each gateway sharing it hears only its own replies
(issue 27, remote workers).

- Heartbeats are bound to the link they arrive on: one naming another worker is ignored,
  and metric label values come from the gateway's own configuration (a heartbeat cannot add
  series). In process, the broker and metrics against a socket standing in for a worker that
  lies.
- Several gateways share one worker host (`client_key_files` lists each one's key): each
  streams its own requests; with its own key, a gateway cannot subscribe to another's
  frames, and its Abort of another's request id stops only a request of its own. Real
  processes over tcp with CURVE: a worker host and two gateways.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import zmq
from fakeworker import LOCAL, until_heard, worker_sockets
from serverctl import Server, free_port_block, small_llm, wait_for

from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.metrics import Metrics
from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.keys import load_keys
from npu_proxy.protocol.liveness import EMBED_BATCH_CLASSES, Heartbeat
from npu_proxy.protocol.messages import (
    Abort,
    ChatMessage,
    Delta,
    Failed,
    Finished,
    Generate,
    SamplingParams,
    encode,
    reply_decoder,
)
from npu_proxy.protocol.sockets import (
    TOPIC_HEARTBEAT,
    TOPIC_REQUEST,
    configure_sub,
    connect,
    reply_topic,
    subscribe_replies,
    worker_endpoint,
)
from npu_proxy.protocol.states import ProcessState

LLM = "smollm2:135m"
# Tokens of A's request: it runs while B's requests and Abort come and go (the test checks
# in the worker's log that it still ran after them). NOTE: the worker host serves the embedded
# model cut to two layers (serverctl.small_llm), at ~200 tokens/s: the test is about whose
# frames go where, never what they say.
LONG = 1000


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
    pull, pub = worker_sockets(ctx, config, "embed")

    async def run() -> None:
        broker = Broker(config)
        metrics = Metrics(config, broker)
        broker.listeners.append(metrics)
        await broker.start()
        try:
            link = broker.links["embed"]
            await until_heard(link, pub, _beat("embed"))
            # The worker on this link names others, with counters and a long batch list.
            for name in ("intruder", "llm", "x" * 200):
                pub.send_multipart((LOCAL, encode(_beat(
                    name, queue=99, cache_hits=50, embed_batches=[1] * 1000))))
            pub.send_multipart((LOCAL, encode(_beat(
                "embed", queue=8, cache_hits=60, embed_batches=[2] * 1000))))
            pub.send_multipart((LOCAL, encode(_beat(
                "embed", queue=7, cache_hits=3, embed_batches=[2] * len(EMBED_BATCH_CLASSES)))))
            deadline = time.monotonic() + 30
            while link.heartbeat.queue != 7:  # NOTE: frames of one link arrive in order
                assert time.monotonic() < deadline, "the last heartbeat never arrived"
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
        pull.close(0)
        pub.close(0)
        ctx.term()


def _generate(rid: str, tokens: int) -> Generate:
    return Generate(id=rid, model=LLM, deadline=time.time() + 600,
                    params=SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0),
                    messages=[ChatMessage(role="user", content="Count to a thousand.")])


class Wire:
    """A gateway's own sockets to the shared worker, with that gateway's keys: PUSH to `in`,
    SUB to its reply topic on `out` (or to whatever `topics` says)."""

    def __init__(self, ctx: zmq.Context[Any], gateway: Server,
                 topics: list[bytes] | None = None) -> None:
        config = gateway.config
        out = worker_endpoint(config, "far", "out")
        self.sub = ctx.socket(zmq.SUB)
        configure_sub(self.sub, None)
        if topics is None:
            subscribe_replies(self.sub, config, out)
        for topic in topics or ():
            self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        connect(self.sub, config, out)
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        connect(self.push, config, worker_endpoint(config, "far", "in"))
        self.decoder = reply_decoder()
        self.heard: list[Any] = []
        # NOTE: a heartbeat heard proves every subscription sent before it was answered.
        self.until(lambda f: isinstance(f, Heartbeat))

    def until(self, match: Callable[[Any], bool], timeout: float = 300.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sub.poll(200):
                frame = self.decoder.decode(self.sub.recv_multipart()[-1])
                self.heard.append(frame)
                if match(frame):
                    return frame
        raise AssertionError("no such frame from the worker")

    def close(self) -> None:
        self.sub.close(0)
        self.push.close(0)


def _stream(gateway: Server, texts: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    chunks = client.chat.completions.create(
        model=LLM, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
        temperature=0, stream=True)
    texts[gateway.url] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_gateways_sharing_a_worker_hear_and_abort_only_their_own(tmp_path: Path) -> None:
    # NOTE: the gateways name the same models as the worker host, as a deployment's would.
    a, b = (Server(tmp_path / n, transport="tcp", tcp_base_port=free_port_block(2),
                   workers=[], models=small_llm()) for n in ("a", "b"))
    for gateway in (a, b):
        gateway.cli("keys")
    port = free_port_block(4)
    host = Server(tmp_path / "w", workers=[{"name": "far", "role": "llm"}], transport="tcp",
                  tcp_base_port=port, models=small_llm(),
                  client_key_files=[str(Path(g.config.keys_path()) / "client.key")
                                    for g in (a, b)])
    host.cli("keys")
    far = {"name": "far", "role": "llm", "address": f"127.0.0.1:{port + 2}",
           "public_key_file": str(Path(host.config.keys_path()) / "server.key")}
    ctx: zmq.Context[Any] = zmq.Context()
    wires: list[Wire] = []
    try:
        host.start(args=["--worker-only"])
        for gateway in (a, b):
            gateway.write_config(workers=[far])
            gateway.start()
        # Each gateway streams its own request, both at once, as soon as its port accepts:
        # a request waits for the first heartbeat its gateway hears from `far`.
        texts: dict[str, str] = {}
        threads = [threading.Thread(target=_stream, args=(g, texts)) for g in (a, b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert set(texts) == {a.url, b.url} and all(texts.values()), texts

        # B, with its own key, asks for everything, for "r" and for A's topic.
        a_topic = reply_topic(load_keys(a.config).client_public)
        spy = Wire(ctx, b, topics=[a_topic, b"", TOPIC_REQUEST, TOPIC_HEARTBEAT])
        wire_a, wire_b = Wire(ctx, a), Wire(ctx, b)
        wires += [spy, wire_a, wire_b]
        wire_a.push.send(encode(_generate("shared", LONG)))
        wire_a.until(lambda f: isinstance(f, Delta) and f.id == "shared")
        # B uses the same id for a request of its own, then aborts "shared": its own.
        wire_b.push.send(encode(_generate("shared", 2)))
        mine = wire_b.until(lambda f: isinstance(f, (Finished, Failed)) and f.id == "shared")
        assert isinstance(mine, Finished) and mine.completion_tokens == 2
        wire_b.push.send(encode(Abort(id="shared")))
        # NOTE: B's next request is taken after its Abort was.
        wire_b.push.send(encode(_generate("after", 1)))
        wire_b.until(lambda f: isinstance(f, Finished) and f.id == "after")
        # NOTE: A's request still ran once B's Abort was taken: before "after", the worker
        # logged one "shared" finished, B's own (ids there are `<link>|<id>`).
        wait_for(lambda: "|after reason=" in host.worker_log("far"), 60,
                 "the worker never logged that 'after' finished")
        log = host.worker_log("far")
        earlier = log[:log.index("|after reason=")]
        assert earlier.count("|shared reason=") == 1, "A's request ended before B's Abort"
        ended = wire_a.until(lambda f: isinstance(f, (Finished, Failed)) and f.id == "shared")
        after = time.time()
        assert isinstance(ended, Finished), ended
        assert ended.finish_reason == "length" and ended.completion_tokens == LONG
        # Each heard one whole stream for "shared" (the other's frames would repeat seqs).
        for wire, last in ((wire_a, ended), (wire_b, mine)):
            frames = [f for f in wire.heard if getattr(f, "id", None) == "shared"]
            assert [f.seq for f in frames] == list(range(len(frames)))
            assert frames[-1] == last
        # The spy heard heartbeats and nothing else: no frame of A's (or B's) requests. A
        # heartbeat sent after A's stream ended comes after anything it could have heard.
        spy.until(lambda f: isinstance(f, Heartbeat) and f.sent_at > after)
        assert {type(f) for f in spy.heard} == {Heartbeat}
        assert "refused a subscription" in host.worker_log("far")
    finally:
        for wire in wires:
            wire.close()
        ctx.term()
        for server in (a, b, host):
            server.stop()
