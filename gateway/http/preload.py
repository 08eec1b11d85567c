"""What the gateway imports only when a request needs it, in a thread: numpy (embeddings,
audio) and Pillow (images: gateway/content/images.py waits for it in a thread of its own).

numpy is 0.15 s of CPU, a sixth of the gateway's imports, all of it before `/health/ready`
when imported at start (bench/start.py). Imported on first use on the event loop, it would
stall every request in flight; imported here, in a thread, it is not. A route that needs it
awaits `numpy_ready()` (at once, once loaded); code that runs in a worker thread may import it
directly.

NOTE: begun by the first request that needs it, not at startup: numpy and Pillow hold 17 MiB
of the gateway's RSS (numpy 15: its code and OpenBLAS's), for a chat-only server nothing;
the first request that needs one pays its import (numpy: about 0.15 s of CPU), for an
embedding on top of the lazy embed worker's start (about 4 s, docs/performance.md, "Lazy
workers").
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading

log = logging.getLogger(__name__)

MODULES = ("numpy", "PIL.Image")

_loaded = threading.Event()
_begun = threading.Lock()
_thread: threading.Thread | None = None


def _load() -> None:
    try:
        for name in MODULES:
            importlib.import_module(name)
    except Exception:  # NOTE: the route's own import then raises it to its request.
        log.exception("preloading %s failed", ", ".join(MODULES))
    finally:
        _loaded.set()


def begin() -> None:
    """Start the imports in a thread (once per process); the first numpy_ready() does."""
    global _thread
    with _begun:
        if _thread is None:
            _thread = threading.Thread(target=_load, name="preload", daemon=True)
            _thread.start()


async def numpy_ready() -> None:
    """Return once numpy is imported, without blocking the event loop while it is."""
    if _loaded.is_set():
        return
    begin()
    await asyncio.to_thread(_loaded.wait)
