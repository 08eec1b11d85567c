"""A bare ASGI app on hypercorn + uvloop, configured as the gateway runs it (no access log,
the same keep-alive), for bench/gateway_cpu.py's floor: what an HTTP request costs any app
on hypercorn, before Starlette, the middleware, routing or a worker.

    python bench/_bare_asgi.py PORT

It reads the whole body and answers every request with one fixed JSON body the size of a
one-text embedding answer; SIGTERM ends it.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

import uvloop
from hypercorn.asyncio import serve
from hypercorn.config import Config

# NOTE: an OpenAI embeddings answer of one 384-dimension vector is about 8 KB of JSON.
BODY = (b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":['
        + b",".join(b"0.012345678" for _ in range(384))
        + b']}],"model":"all-minilm","usage":{"prompt_tokens":8,"total_tokens":8}}')
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})


async def main(port: int) -> None:
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.loglevel = "WARNING"
    config.keep_alive_timeout = 75.0
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1])))
