"""The gateway's own CPU time per streamed token and per embedding request.

    python bench/gateway_cpu.py [--streams 32] [--tokens 64] [--rounds 3]
                                [--embed-clients 16] [--embed-requests 40]
                                [--only stream|embed] [--url URL [--config npu-proxy.toml]]

Without --url a private server is started (one llm and one embed worker on the CPU). The
gateway process is found from the supervisor's status (the child named "gateway"); its CPU
time is its utime + stime from /proc/<pid>/stat (all its threads: the event loop and
ZeroMQ's I/O thread), read before and after each fixed piece of work:

- OpenAI chat streaming (`/v1/chat/completions`, `stream_options.include_usage`,
  `ignore_eos`) and Ollama chat streaming (`/api/chat`, `num_predict`): `--streams`
  concurrent clients, each `--rounds` requests one after the other, `--tokens` each; the
  ratio is the gateway's CPU over the completion tokens the responses counted (usage /
  eval_count). The HTTP chunks the client read per token are printed beside it.
- Embeddings (`/v1/embeddings`, `/api/embed`): `--embed-clients` concurrent clients, each
  `--embed-requests` requests of one short text, a new text every request (so no vector cache
  answers); the ratio is the gateway's CPU per request. `GET /health` the same way: what a
  request costs the gateway with no work behind it (hypercorn, the middleware, routing).
- The floor: a bare ASGI app on hypercorn + uvloop (`bench/_bare_asgi.py`: no Starlette, no
  middleware, no worker; one fixed answer the size of an embedding's), in a process of its
  own, read by the same embedding clients. What any app on hypercorn pays per request on
  this machine; the embeddings' ratios to it are printed last.

One untimed round of each runs first (worker warm, connections open). The idle gateway's CPU
(heartbeats, status) over a quiet second is printed too; it is included in the ratios, not
subtracted. Nothing here times the work: the ratios are CPU seconds over counts, and the
machine's other load changes them little (a loaded machine makes the gateway's wall time
longer, not its CPU time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from load import TICKS, _cli_status, _cpu_ticks
from serverctl import Server, free_port

MODEL = "smollm2:135m"
EMBED_MODEL = "all-minilm"
DECODER = msgspec.json.Decoder()
_texts = itertools.count()


@dataclass
class Served:
    """What the clients read in one piece of work."""

    units: int = 0  # tokens (streams) or requests (embeddings)
    chunks: int = 0  # HTTP body pieces the client read


def _prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long story about island number {i}."}]


async def openai_stream(client: httpx.AsyncClient, url: str, i: int, tokens: int) -> Served:
    body = {"model": MODEL, "messages": _prompt(i), "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    served = Served()
    buf = b""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for piece in r.aiter_bytes():
            served.chunks += 1
            buf += piece
    for line in buf.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            usage = DECODER.decode(line[6:]).get("usage")
            if usage:
                served.units = int(usage["completion_tokens"])
    return served


async def ollama_stream(client: httpx.AsyncClient, url: str, i: int, tokens: int) -> Served:
    body = {"model": MODEL, "messages": _prompt(i), "stream": True,
            "options": {"num_predict": tokens, "temperature": 0}}
    served = Served()
    buf = b""
    async with client.stream("POST", url + "/api/chat", json=body) as r:
        r.raise_for_status()
        async for piece in r.aiter_bytes():
            served.chunks += 1
            buf += piece
    last = DECODER.decode(buf.rstrip(b"\n").rsplit(b"\n", 1)[-1])
    served.units = int(last.get("eval_count") or 0)
    return served


async def openai_embed(client: httpx.AsyncClient, url: str, i: int, _: int) -> Served:
    body = {"model": EMBED_MODEL, "input": f"a short text, number {next(_texts)}"}
    r = await client.post(url + "/v1/embeddings", json=body)
    r.raise_for_status()
    return Served(units=1, chunks=1)


async def health(client: httpx.AsyncClient, url: str, i: int, _: int) -> Served:
    r = await client.get(url + "/health")
    r.raise_for_status()
    return Served(units=1, chunks=1)


async def ollama_embed(client: httpx.AsyncClient, url: str, i: int, _: int) -> Served:
    body = {"model": EMBED_MODEL, "input": f"a short text, number {next(_texts)}"}
    r = await client.post(url + "/api/embed", json=body)
    r.raise_for_status()
    return Served(units=1, chunks=1)


One = Callable[[httpx.AsyncClient, str, int, int], Awaitable[Served]]


async def work(url: str, one: One, clients: int, rounds: int, tokens: int) -> Served:
    """`clients` concurrent clients, each `rounds` requests in a row; what they read."""
    total = Served()

    async def client_loop(n: int) -> None:
        async with httpx.AsyncClient(timeout=300.0) as client:
            for r in range(rounds):
                got = await one(client, url, n * rounds + r, tokens)
                total.units += got.units
                total.chunks += got.chunks

    await asyncio.gather(*(client_loop(n) for n in range(clients)))
    return total


def measure(gateway: int, url: str, name: str, one: One, clients: int, rounds: int,
            tokens: int, unit: str, who: str = "gateway") -> float:
    """One untimed round, then the work; prints and returns the CPU ms per unit of the
    process `gateway` (the gateway, or `who` names another)."""
    asyncio.run(work(url, one, clients, 1, tokens))
    cpu0 = _cpu_ticks(gateway)
    served = asyncio.run(work(url, one, clients, rounds, tokens))
    cpu = (_cpu_ticks(gateway) - cpu0) / TICKS
    per = cpu / max(served.units, 1) * 1000
    print(f"{name:<22} {clients:3d} clients x {rounds} : {served.units:7d} {unit}s, "
          f"{who} CPU {cpu:6.2f} s = {per:.3f} ms per {unit}"
          + (f"  ({served.chunks / max(served.units, 1):.2f} HTTP chunks read per {unit})"
             if unit == "token" else ""), flush=True)
    return per


def idle_rate(gateway: int, seconds: float = 2.0) -> float:
    cpu0 = _cpu_ticks(gateway)
    time.sleep(seconds)
    return (_cpu_ticks(gateway) - cpu0) / TICKS / seconds * 1000


def bare_floor(args: argparse.Namespace) -> float:
    """The CPU ms per request of a bare ASGI app on hypercorn, for the same clients."""
    port = free_port()
    bare = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_bare_asgi.py")),
                             str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/", timeout=5.0)
                break
            except httpx.TransportError:
                if bare.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the bare hypercorn app did not start") from None
                time.sleep(0.1)
        return measure(bare.pid, url, "bare ASGI + hypercorn", openai_embed,
                       args.embed_clients, args.embed_requests, 0, "request", who="its")
    finally:
        bare.terminate()
        bare.wait(timeout=30)


def run(url: str, gateway: int, args: argparse.Namespace) -> None:
    print(f"gateway pid {gateway}; idle: {idle_rate(gateway):.1f} ms of CPU per second",
          flush=True)
    if args.only in (None, "stream"):
        for name, one in (("OpenAI chat stream", openai_stream),
                          ("Ollama /api/chat stream", ollama_stream)):
            measure(gateway, url, name, one, args.streams, args.rounds, args.tokens, "token")
    if args.only in (None, "embed"):
        per = {name: measure(gateway, url, name, one, args.embed_clients,
                             args.embed_requests, 0, "request")
               for name, one in (("/v1/embeddings", openai_embed),
                                 ("/api/embed", ollama_embed), ("GET /health", health))}
        floor = bare_floor(args)
        # NOTE: CPU time is read in clock ticks (10 ms): a short run can read none.
        print("ratios to the bare hypercorn app: " + (", ".join(
            f"{name} x{cost / floor:.2f}" for name, cost in per.items()) if floor else
            "none (the bare app's CPU time read 0 ticks: give more --embed-requests)"),
            flush=True)


def _gateway_pid(status: Any) -> int:
    return next(int(c["pid"]) for c in status["children"] if c["name"] == "gateway")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--embed-clients", type=int, default=16)
    parser.add_argument("--embed-requests", type=int, default=40)
    parser.add_argument("--only", choices=("stream", "embed"))
    parser.add_argument("--url", help="a running server instead of a private one")
    parser.add_argument("--config", help="with --url: its npu-proxy.toml, to find the gateway")
    args = parser.parse_args()
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    if args.url:
        run(args.url.rstrip("/"), _gateway_pid(_cli_status(args.config)), args)
        return 0
    with tempfile.TemporaryDirectory(prefix="npx-bench-gwcpu-") as tmp:
        server = Server(Path(tmp), workers=[{"name": "llm", "role": "llm"},
                                            {"name": "embed", "role": "embed"}]).start()
        try:
            reply = server.status()
            gateway = _gateway_pid({"children": [c.as_json() for c in reply.children]})
            print(f"private server {server.url}: one llm and one embed worker on CPU")
            run(server.url, gateway, args)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
