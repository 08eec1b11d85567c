"""Run the gateway: `python -m npu_proxy.gateway --config <file>` (the supervisor does this)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig

from npu_proxy.gateway.app import Gateway
from npu_proxy.protocol.config import read_config_file
from npu_proxy.protocol.logs import setup_logging

log = logging.getLogger("gateway")


async def _serve(config_path: Path) -> None:
    config = read_config_file(config_path)
    setup_logging("gateway", config.log_level, config.log_format)
    hc = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = 2.0
    hc.keep_alive_timeout = 75.0
    # NOTE: hypercorn's default listen backlog (100) reset ~57 of 512 clients that connected
    # at once (bench/load.py; the kernel counted 538 listen overflows). The kernel caps it at
    # net.core.somaxconn (4096 here).
    hc.backlog = 2048
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # NOTE: not "listening on": the supervisor says that once the workers are ready.
    log.info("gateway accepting HTTP on http://%s:%d", config.host, config.port)
    gateway = Gateway(config)

    async def stopped() -> None:
        await stop.wait()
        # NOTE: open status pages' event streams end now, instead of holding hypercorn's
        # graceful wait (for the requests in flight) to its end.
        gateway.status.close()

    await serve(gateway.app(), hc, shutdown_trigger=stopped)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m npu_proxy.gateway")
    parser.add_argument("--config", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # NOTE: no uvloop on Windows; the standard loop works, slower.
        asyncio.run(_serve(args.config))
    else:
        uvloop.run(_serve(args.config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
