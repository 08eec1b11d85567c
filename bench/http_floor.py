"""How close to the worker any HTTP front end on hypercorn can get, for bench/embeddings.py's
concurrent figure (16 single-text clients at once against one in-process call of 16).

    python bench/http_floor.py [--rounds 20] [--concurrency 16]

A private server is started (the embed worker only, vector cache off). Beside its gateway,
this script serves a bare ASGI app on hypercorn, the way the gateway runs it (uvloop, no
access log): no Starlette, no middleware, no routing, no metrics; it parses the OpenAI body,
pushes an Embed straight to the same worker, awaits the answer and writes the OpenAI JSON.
Five sides take turns in blocks (first call of each block untimed), every call on 16 new
texts: in-process one call of 16; the worker over ZeroMQ (16 requests at once, no HTTP); the
bare app; the gateway; and, if uvicorn and httptools are installed (they are not
dependencies), the bare app on uvicorn's httptools parser. Ratios are in-process / side.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openvino_genai as ov_genai
from embeddings import Burst, Direct, make_texts
from serverctl import Server, free_port, wait_for

from npu_proxy.models.locate import minilm_ir_folder
from npu_proxy.protocol.config import load_config
from npu_proxy.protocol.liveness import Heartbeat
from npu_proxy.protocol.messages import Embed, Embeddings, encode, reply_decoder
from npu_proxy.protocol.sockets import (
    configure_push,
    configure_sub,
    connect,
    subscribe_replies,
    worker_endpoint,
)
from npu_proxy.workers.embed_model import embedding_config

BLOCK = 3


def bare_app(config_path: Path, worker: str) -> Any:
    """The least an HTTP front end does for POST /v1/embeddings (no checks, no limits)."""
    config = load_config(config_path, env={})
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    configure_push(push)
    connect(push, config, worker_endpoint(config, worker, "in"))
    push_now: zmq.Socket[bytes] = zmq.Socket.shadow(push.underlying)
    sub = ctx.socket(zmq.SUB)
    out = worker_endpoint(config, worker, "out")
    configure_sub(sub, None)
    # NOTE: a heartbeat heard (the worker sends them on this reply topic too) proves the
    # subscription reached the worker; until then GET answers 503 (answers published before
    # it would be lost).
    subscribe_replies(sub, config, out)
    heard = asyncio.Event()
    connect(sub, config, out)
    sub_now: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
    waiting: dict[str, asyncio.Future[Any]] = {}
    ids = itertools.count()
    replies = reply_decoder()
    bodies = msgspec.json.Decoder()

    async def read() -> None:
        while True:
            frames = await sub.recv_multipart()
            while True:
                msg = replies.decode(frames[-1])
                if isinstance(msg, Heartbeat):
                    heard.set()
                else:
                    future = waiting.pop(msg.id, None)
                    if future is not None and not future.done():
                        future.set_result(msg)
                try:
                    frames = sub_now.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    asyncio.get_running_loop().create_task(read())
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "GET":
            out, status = b"{}", 200 if heard.is_set() else 503
        else:
            req = bodies.decode(body)
            texts = req["input"] if isinstance(req["input"], list) else [req["input"]]
            rid = f"floor-{next(ids)}"
            future = asyncio.get_running_loop().create_future()
            waiting[rid] = future
            push_now.send(encode(Embed(id=rid, model=req["model"], texts=texts,
                                       deadline=time.time() + 60)), zmq.NOBLOCK)
            reply = await future
            if isinstance(reply, Embeddings):
                vectors = np.frombuffer(reply.data, dtype="<f4").reshape(reply.rows,
                                                                         reply.dims)
                out, status = msgspec.json.encode({
                    "object": "list", "model": req["model"],
                    "data": [{"object": "embedding", "index": i, "embedding": v.tolist()}
                             for i, v in enumerate(vectors)],
                    "usage": {"prompt_tokens": sum(reply.prompt_tokens),
                              "total_tokens": sum(reply.prompt_tokens)}}), 200
            else:
                out, status = msgspec.json.encode({"error": repr(reply)}), 500
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    # NOTE: the shadows do not own their sockets: these must outlive the app.
    app.sockets = (ctx, push, sub)  # type: ignore[attr-defined]
    return app


def serve(config_path: Path, worker: str, port: int, server: str) -> None:
    import uvloop

    app = bare_app(config_path, worker)
    if server == "uvicorn":
        import uvicorn

        uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                    log_level="warning", access_log=False)
        return
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config as HypercornConfig

    hc = HypercornConfig()
    hc.bind = [f"127.0.0.1:{port}"]
    hc.accesslog = None
    uvloop.run(hypercorn_serve(app, hc))


def start_bare(config_path: Path, server: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", server, "--config",
                             str(config_path), "--port", str(port)])
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            import httpx
            return httpx.get(url + "/", timeout=2).status_code == 200
        except Exception:
            return False

    wait_for(up, 60, f"the bare app on {server}")
    return proc, url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--serve", choices=("hypercorn", "uvicorn"), help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.config, "embed", args.port, args.serve)
        return 0

    n = args.concurrency
    tmp = Path(tempfile.mkdtemp(prefix="npx-bench-floor-"))
    print(f"starting a private server in {tmp} (embed worker only, cache size 0)")
    server = Server(tmp, workers=[{"name": "embed", "role": "embed"}],
                    embedding_cache_size=0).start()
    procs: list[subprocess.Popen[bytes]] = []
    bursts: list[Burst] = []
    direct: Direct | None = None
    try:
        pipe = ov_genai.TextEmbeddingPipeline(str(minilm_ir_folder(server.config)), "CPU",
                                              embedding_config())
        texts = iter(make_texts(4 * n * (BLOCK + 1) * args.rounds * 5 + 4 * n))
        direct = Direct(server.config, "embed")
        sides: dict[str, Callable[[list[str]], float]] = {}

        def local(chunk: list[str]) -> float:
            started = time.perf_counter()
            pipe.embed_documents(chunk)
            return time.perf_counter() - started

        sides["in-process, one call"] = local
        sides["worker over ZeroMQ"] = direct.run
        fronts = ["hypercorn"]
        if importlib.util.find_spec("uvicorn") and importlib.util.find_spec("httptools"):
            fronts.append("uvicorn")
        for front in fronts:
            proc, url = start_bare(server.config_path, front)
            procs.append(proc)
            burst = Burst(url, n)
            bursts.append(burst)
            sides[f"bare app on {front}"] = burst.run
        gateway = Burst(server.url, n)
        bursts.append(gateway)
        sides["the gateway"] = gateway.run
        for burst in bursts:
            burst.open()
            burst.run([next(texts) for _ in range(n)])
        names = list(sides)
        took: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                for i in range(BLOCK + 1):
                    spent = sides[name]([next(texts) for _ in range(n)])
                    if i:
                        took[name].append(spent)
        base = statistics.median(took[names[0]])
        print(f"\n{n} single-text requests at once vs one in-process call of {n} "
              f"({args.rounds} rounds of {BLOCK} timed calls per side, medians):")
        for name in names:
            med = statistics.median(took[name])
            print(f"  {name:<24} {med * 1e3:6.1f} ms  ratio {base / med:.3f}")
    finally:
        for burst in bursts:
            burst.close()
        if direct is not None:
            direct.close()
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
