"""Ollama's `keep_alive`: how long a model stays loaded after a request.

The Switcher (gateway/core/switching.py) remembers it per model with the time of the
request, and /api/ps `expires_at` is computed from that (last use + keep_alive, like Ollama).
NOTE: a resident worker (the default model's) keeps its configured model loaded for its whole
life; only a model it was switched to is unloaded when its keep_alive runs out, and a model
not used yet was loaded at start-up with no deadline, so it reports Ollama's "forever" date.
A lazy worker is unloaded after its own keep_alive (WorkerSpec.keep_alive,
gateway/core/residency.py), which /api/ps reports instead.
"""

from __future__ import annotations

import math
import re

from npu_proxy.gateway.core.errors import invalid

DEFAULT_KEEP_ALIVE = 300.0  # Ollama's default: five minutes

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
                 "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: float | str | None) -> float:
    """Seconds to keep a model loaded: `math.inf` for forever, 0 to unload.

    A number is seconds; a string is a Go duration ("5m", "1h30m", "-1s") or a plain number;
    anything negative means forever; absent means the five-minute default.
    """
    if value is None:
        return DEFAULT_KEEP_ALIVE
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            parts = _DURATION_PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise invalid(f"keep_alive: invalid duration {value!r} (use e.g. 300, \"5m\","
                              " \"1h30m\" or -1)", param="keep_alive") from None
            seconds = sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    else:
        seconds = float(value)
    if math.isnan(seconds):
        raise invalid("keep_alive: not a number", param="keep_alive")
    return math.inf if seconds < 0 else seconds
