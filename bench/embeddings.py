"""Embeddings/s in-process versus through HTTP, and concurrent single-text clients.

    python bench/embeddings.py [--url URL] [--rounds 4] [--seconds 3] [--concurrency 16]
                                [--format float|base64|both] [--batch-wait S]
                                [--only-concurrent]

Without --url a private server is started with only the embedding worker and a vector cache
of size 0, so every request reaches the pipeline, as the in-process calls do. Both sides embed
the same batches of the same texts with the same IR folder and pipeline settings, taking
turns in short blocks so load from other processes on the machine falls on both alike.
Ratios are HTTP / in-process throughput. The HTTP side is run with both encoding formats:
base64 (the official OpenAI SDK's default) and float (JSON numbers).

Batches of 1, 8 and 32 are sent one request at a time, so each pays the server's fixed cost
per request (HTTP, two ZeroMQ hops, JSON) on top of the pipeline's time; the "fixed" column
is that cost as implied by the ratio, and the floor line is a bare HTTP round trip to the
same server for scale (bench/embed_costs.py splits the fixed cost by layer).

Then the figure of issue 19: N (16) concurrent clients, each sending one text on its own
keep-alive connection, against one in-process call of the same N texts, in alternating
rounds; the server must batch them (its pipeline calls per burst are read from /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openvino_genai as ov_genai
from serverctl import MODEL_CACHE, Server

from npu_proxy.models.locate import MINILM_IR_FOLDER, minilm_ir_folder
from npu_proxy.protocol.config import Config
from npu_proxy.protocol.messages import Embed, Embeddings, encode, reply_decoder
from npu_proxy.protocol.sockets import (
    configure_push,
    configure_sub,
    connect,
    subscribe_replies,
    worker_endpoint,
)
from npu_proxy.workers.embed_model import embedding_config

MODEL = "all-minilm:l6-v2"
BATCH_SIZES = (1, 8, 32)
# Seconds each side runs before the other takes its turn.
BLOCK_S = 0.5
# Timed calls per side per round of the concurrent-clients figure (after one untimed).
CONCURRENT_BLOCK = 3
WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "river",
    "stones", "glitter", "under", "pale", "morning", "light", "and", "distant", "bells", "ring",
    "across", "quiet", "valleys", "where", "farmers", "gather", "grain", "markets", "open",
    "traders", "argue", "prices", "rise", "engineers", "measure", "voltage", "across", "silicon",
    "wafers", "students", "read", "history", "poems", "recall", "ancient", "harbours", "ships",
    "sail",
]


def make_texts(n: int, seed: int = 7) -> list[str]:
    """Distinct sentences of 6 to 40 words (about 8 to 50 tokens)."""
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 40)))
            for i in range(n)]


class Embedder:
    def __init__(self, pipe: Any, url: str) -> None:
        self.pipe = pipe
        self.url = url
        # "float" (JSON numbers, as Ollama and raw JSON clients get them) or "base64" (the
        # official OpenAI SDK's default: the vectors' float32 bytes, decoded with numpy).
        self.format = "float"
        parts = urlsplit(url)
        # NOTE: the stdlib client on one kept-alive connection costs the least client-side CPU,
        # which on a small machine is taken from the server being measured.
        self.conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port,
                                               timeout=120)
        self.decoder = msgspec.json.Decoder()

    def local(self, batch: list[str]) -> int:
        return len(self.pipe.embed_documents(batch))

    def ping(self, count: int = 200) -> float:
        """Seconds per bare HTTP round trip (GET /health) on the same connection."""
        started = time.perf_counter()
        for _ in range(count):
            self.conn.request("GET", "/health")
            self.conn.getresponse().read()
        return (time.perf_counter() - started) / count

    def http(self, batch: list[str]) -> int:
        body = msgspec.json.encode({"model": MODEL, "input": batch,
                                    "encoding_format": self.format})
        self.conn.request("POST", "/v1/embeddings", body,
                          {"content-type": "application/json"})
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
        items = self.decoder.decode(data)["data"]
        if self.format == "base64":
            vectors = [np.frombuffer(base64.b64decode(i["embedding"]), dtype="<f4")
                       for i in items]
            return len(vectors)
        return len(items)

    def close(self) -> None:
        self.conn.close()


class Direct:
    """Embed requests pushed straight to an embedding worker's socket and its answers read
    from its PUB, as the gateway does: the worker process and two ZeroMQ hops, no HTTP."""

    def __init__(self, config: Config, worker: str) -> None:
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        configure_push(self.push)
        connect(self.push, config, worker_endpoint(config, worker, "in"))
        self.sub = self.ctx.socket(zmq.SUB)
        out = worker_endpoint(config, worker, "out")
        configure_sub(self.sub, None)
        subscribe_replies(self.sub, config, out)  # NOTE: heartbeats come there too
        connect(self.sub, config, out)
        self.decoder = reply_decoder()
        # NOTE: a SUB hears a PUB only once its subscription got there; a heartbeat heard
        # proves it did (answers published before would be lost).
        if not self.sub.poll(30_000):
            raise SystemExit(f"no heartbeat from worker {worker} within 30 s")
        self.sub.recv_multipart()

    def run(self, texts: list[str]) -> float:
        """Seconds until each of `texts`, sent as a request of its own all at once, is
        answered."""
        started = time.perf_counter()
        waiting: set[str] = set()
        for text in texts:
            rid = uuid.uuid4().hex
            waiting.add(rid)
            self.push.send(encode(Embed(id=rid, model=MODEL, texts=[text],
                                        deadline=time.time() + 60)))
        while waiting:
            if not self.sub.poll(60_000):
                raise RuntimeError(f"{len(waiting)} answers missing after 60 s")
            frame = self.decoder.decode(self.sub.recv_multipart()[-1])
            if getattr(frame, "id", None) in waiting:
                if not isinstance(frame, Embeddings):
                    raise RuntimeError(f"the worker answered {frame!r}")
                waiting.discard(frame.id)
        return time.perf_counter() - started

    def close(self) -> None:
        self.push.close(0)
        self.sub.close(0)
        self.ctx.term()


def timed(fn: Callable[[list[str]], int], batches: list[list[str]]) -> tuple[int, float]:
    started = time.perf_counter()
    done = sum(fn(b) for b in batches)
    return done, time.perf_counter() - started


def throughput(emb: Embedder, texts: list[str], size: int, rounds: int,
               seconds: float) -> tuple[float, float, float, list[float]]:
    """Texts/s in-process and over HTTP on identical batches, their ratio, each round's.

    The two sides take turns in blocks of about BLOCK_S (which goes first flips every
    block), each embedding the same batches. The first call of a block is not timed:
    OpenVINO's threads keep spinning for about a millisecond after a call returns (measured
    here), and that would charge one side for the other's. Rates are from the median call;
    the ratio is the median of per-batch ratios, so a burst of load from elsewhere on the
    machine (this one is a shared VM) moves neither much.
    """
    probe = [texts[i:i + size] for i in range(0, 3 * size, size)]
    timed(emb.local, probe)
    timed(emb.http, probe)
    _, spent = timed(emb.local, probe)
    per_call = spent / len(probe)
    block = max(2, int(BLOCK_S / per_call))
    blocks = max(2, round(seconds / (block * per_call)))
    count = blocks * block
    if count * size > len(texts):
        raise SystemExit(f"batch {size}: {count * size} texts needed, {len(texts)} made")
    calls: dict[str, list[float]] = {"local": [], "http": []}
    ratios: list[float] = []
    per_round: list[float] = []
    for r in range(rounds):
        start = (r * count * size) % max(1, len(texts) - count * size + 1)
        mine: list[float] = []
        for b in range(blocks):
            first = start + b * block * size
            batches = [texts[first + i * size:first + (i + 1) * size] for i in range(block)]
            order = (emb.local, emb.http) if b % 2 == 0 else (emb.http, emb.local)
            took: dict[str, list[float]] = {}
            for fn in order:
                fn(batches[0])
                took[fn.__name__] = [timed(fn, [batch])[1] for batch in batches[1:]]
                calls[fn.__name__] += took[fn.__name__]
            mine += [lo / ht for lo, ht in zip(took["local"], took["http"], strict=True)]
        per_round.append(statistics.median(mine))
        ratios += mine
    local = size / statistics.median(calls["local"])
    http = size / statistics.median(calls["http"])
    return local, http, statistics.median(ratios), per_round


class Burst:
    """n keep-alive HTTP/1.1 connections, one per client, each sending one text at a time.

    Requests are written as bytes on asyncio streams and answers read by Content-Length:
    the least client CPU per request, which on a 2-core machine is taken from the server
    being measured (an httpx.AsyncClient costs several times as much per request).
    """

    def __init__(self, url: str, n: int) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.n = n
        self.loop = asyncio.new_event_loop()
        self.conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    def open(self) -> None:
        async def connect() -> None:
            for _ in range(self.n):
                self.conns.append(await asyncio.open_connection(self.host, self.port))

        self.loop.run_until_complete(connect())

    async def _one(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                   text: str) -> None:
        reader, writer = conn
        body = msgspec.json.encode({"model": MODEL, "input": text, "encoding_format": "float"})
        writer.write(b"POST /v1/embeddings HTTP/1.1\r\nhost: %s\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (self.host.encode(), len(body), body))
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, val = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(val)
        data = await reader.readexactly(length)
        if status != b"200":
            raise RuntimeError(f"HTTP {status.decode()}: {data[:300]!r}")

    def run(self, texts: list[str]) -> float:
        """Seconds until all of `texts` (one per connection) are answered."""
        async def burst() -> float:
            started = time.perf_counter()
            await asyncio.gather(*(self._one(c, t) for c, t in zip(self.conns, texts,
                                                                   strict=True)))
            return time.perf_counter() - started

        return self.loop.run_until_complete(burst())

    def close(self) -> None:
        for _, writer in self.conns:
            writer.close()
        self.loop.close()


async def _httpx_burst(url: str, texts: list[str]) -> float:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=256)) as client:
        async def one(text: str) -> None:
            r = await client.post(url + "/v1/embeddings", json={
                "model": MODEL, "input": text, "encoding_format": "float"})
            r.raise_for_status()

        await asyncio.gather(*(one(t) for t in texts))  # NOTE: opens the connections.
        started = time.perf_counter()
        await asyncio.gather(*(one(t) for t in texts))
        return time.perf_counter() - started


def _scrape_calls(url: str) -> tuple[dict[str, float], float]:
    """(pipeline calls by size class, texts embedded) of the server's embedding workers."""
    text = httpx.get(url + "/metrics", timeout=10).text
    calls: dict[str, float] = {}
    misses = 0.0
    for line in text.splitlines():
        if line.startswith("npu_proxy_embedding_batches_total{"):
            size = line.split('size="', 1)[1].split('"', 1)[0]
            calls[size] = calls.get(size, 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("npu_proxy_embedding_cache_misses_total{"):
            misses += float(line.rsplit(" ", 1)[1])
    return calls, misses


def concurrent_clients(emb: Embedder, texts: list[str], n: int, rounds: int,
                       direct: Direct | None = None) -> dict[str, Any]:
    """n concurrent single-text clients through HTTP against one in-process call of n texts.

    As in throughput(), the sides take turns in blocks (the order rotates every round) and
    the first call of a block is not timed, so no side is charged for another's still-spinning
    threads; every call embeds n new texts. The ratio is the median of the pairs'
    in-process / HTTP times. With `direct`, a third side sends the same n requests straight
    to the worker over ZeroMQ (no HTTP): what the worker alone allows. Also: the same n texts
    sent one after the other, in-process as n calls of 1, and through httpx.
    """
    burst = Burst(emb.url, n)
    burst.open()
    burst.run(texts[:n])  # NOTE: every connection has carried one request before timing.
    calls_before, texts_before = _scrape_calls(emb.url)
    sides: dict[str, Callable[[list[str]], float]] = {
        "local": lambda chunk: timed(emb.local, [chunk])[1], "http": burst.run}
    if direct is not None:
        sides["direct"] = direct.run
    names = list(sides)
    took: dict[str, list[float]] = {name: [] for name in names}
    ratios: list[float] = []
    served = 0
    chunks = iter([texts[i:i + n] for i in range(n, len(texts) - n + 1, n)])
    for r in range(rounds):
        mine: dict[str, list[float]] = {name: [] for name in names}
        for name in names[r % len(names):] + names[:r % len(names)]:
            for i in range(CONCURRENT_BLOCK + 1):
                chunk = next(chunks, None)
                if chunk is None:
                    raise SystemExit(f"{rounds} rounds of {n} need more texts")
                spent = sides[name](chunk)
                served += name != "local"
                if i:
                    mine[name].append(spent)
        for name in names:
            took[name] += mine[name]
        ratios += [lo / ht for lo, ht in zip(mine["local"], mine["http"], strict=True)]
    burst.close()
    # NOTE: the worker's counters reach /metrics with its next heartbeat.
    deadline = time.monotonic() + 10
    calls, embedded = _scrape_calls(emb.url)
    while embedded - texts_before < served * n and time.monotonic() < deadline:
        time.sleep(0.1)
        calls, embedded = _scrape_calls(emb.url)
    extra, more = next(chunks), next(chunks)
    seq = timed(emb.http, [[t] for t in extra])[1]
    singles = timed(emb.local, [[t] for t in extra])[1]
    with_httpx = asyncio.run(_httpx_burst(emb.url, more))
    made = {k: v - calls_before.get(k, 0.0) for k, v in calls.items()}
    local = statistics.median(took["local"])
    return {"concurrent": statistics.median(took["http"]), "local_batch": local,
            "direct": statistics.median(took["direct"]) if direct is not None else None,
            "direct_ratio": (statistics.median([lo / d for lo, d in zip(
                took["local"], took["direct"], strict=True)]) if direct is not None else None),
            "ratio": statistics.median(ratios), "ratios": ratios,
            "calls_per_burst": sum(made.values()) / served,
            "sizes": ", ".join(f"{int(v)} of {k}" for k, v in made.items() if v),
            "sequential": seq, "local_singles": singles, "httpx": with_httpx}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (its cache makes repeats free: "
                                      "start it with embedding_cache_size = 0)")
    parser.add_argument("--model-dir", help="the IR folder that server loads (with --url)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0, help="per side per round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--batch-wait", type=float,
                        help="the private server's embedding_batch_wait (seconds)")
    parser.add_argument("--only-concurrent", action="store_true",
                        help="skip the batch 1/8/32 table")
    parser.add_argument("--format", choices=("float", "base64", "both"), default="both",
                        help="encoding_format of the HTTP side")
    args = parser.parse_args()

    server: Server | None = None
    if args.url:
        url = args.url.rstrip("/")
        folder = Path(args.model_dir) if args.model_dir else MODEL_CACHE / MINILM_IR_FOLDER
    else:
        tmp = Path(tempfile.mkdtemp(prefix="npx-bench-embed-"))
        print(f"starting a private server in {tmp} (embed worker only, cache size 0)")
        extra = {} if args.batch_wait is None else {"embedding_batch_wait": args.batch_wait}
        server = Server(tmp, workers=[{"name": "embed", "role": "embed"}],
                        embedding_cache_size=0, **extra).start()
        url = server.url
        folder = minilm_ir_folder(server.config)
    try:
        pipe = ov_genai.TextEmbeddingPipeline(str(folder), "CPU", embedding_config())
        texts = make_texts(8192)
        emb = Embedder(pipe, url)
        try:
            print(f"model {MODEL} ({folder}); {args.rounds} alternating rounds of "
                  f"~{args.seconds:.1f} s per side")
            formats: tuple[str, ...] = (("base64", "float") if args.format == "both"
                                        else (args.format,))
            if args.only_concurrent:
                formats = ()
            for fmt in formats:
                emb.format = fmt
                print(f"\nencoding_format={fmt}")
                print(f"{'batch':>5} {'in-process/s':>13} {'HTTP/s':>9} {'ratio':>6} "
                      f"{'per call':>9} {'fixed':>8}  ratio per round")
                for size in BATCH_SIZES:
                    local, http, ratio, ratios = throughput(emb, texts, size, args.rounds,
                                                            args.seconds)
                    per_round = " ".join(f"{r:.2f}" for r in ratios)
                    call = size / local
                    fixed = call * (1 / ratio - 1)
                    print(f"{size:>5} {local:>13.1f} {http:>9.1f} {ratio:>6.3f} "
                          f"{call * 1e3:>6.1f} ms {fixed * 1e3:>+5.1f} ms  {per_round}")
            floor = emb.ping()
            print(f"floor: a bare HTTP round trip (GET /health) takes {floor * 1e3:.2f} ms; "
                  "0.95 needs a fixed cost under 1/19 of the pipeline's time per call")
            n = args.concurrency
            rounds = max(10, 5 * args.rounds)
            # NOTE: straight to the worker only on a private server (its sockets are known).
            direct = Direct(server.config, "embed") if server is not None else None
            try:
                got = concurrent_clients(emb, texts[4096:], n, rounds, direct)
            finally:
                if direct is not None:
                    direct.close()
            spread = sorted(got["ratios"])
            print(f"\n{n} concurrent single-text clients through HTTP vs one in-process call "
                  f"of {n} texts ({rounds} alternating rounds of {CONCURRENT_BLOCK} timed calls "
                  "per side, medians):")
            print(f"  in-process, one call of {n}: {got['local_batch'] * 1e3:7.1f} ms "
                  f"({n / got['local_batch']:.1f} texts/s)")
            print(f"  HTTP, {n} concurrent clients: {got['concurrent'] * 1e3:7.1f} ms "
                  f"({n / got['concurrent']:.1f} texts/s), "
                  f"{got['calls_per_burst']:.1f} pipeline calls per burst")
            if got["direct"] is not None:
                print(f"  straight to the worker over ZeroMQ, {n} requests at once (no HTTP): "
                      f"{got['direct'] * 1e3:.1f} ms, ratio {got['direct_ratio']:.3f} "
                      "(what the worker process allows)")
            print(f"  the server's pipeline calls by texts per call: {got['sizes']}")
            print(f"  ratio {got['ratio']:.3f} (pairs' quartiles {spread[len(spread) // 4]:.2f}"
                  f"-{spread[3 * len(spread) // 4]:.2f}; target >= 0.9)")
            print(f"  for scale, once each: the same {n} one after the other over HTTP "
                  f"{got['sequential'] * 1e3:.1f} ms, in-process as {n} calls of 1 "
                  f"{got['local_singles'] * 1e3:.1f} ms; {n} concurrent from an "
                  f"httpx.AsyncClient {got['httpx'] * 1e3:.1f} ms")
        finally:
            emb.close()
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
