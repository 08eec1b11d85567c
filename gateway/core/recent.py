"""The last minutes of the gateway's work, for the status page (gateway/pages/status.py).

Fed by gateway/core/metrics.py at the same hooks that feed its Prometheus families (tokens,
TTFT, worker exits and errors, 5xx answers), so both say the same; everything here is bounded
in memory: per-second token counts over the longest window, the last finished generations,
the last errors.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Seconds of each window the status page shows (1 and 5 minutes).
WINDOWS = (60, 300)
# NOTE: past this many generations in a window, its TTFT median is that of the latest ones.
MAX_FINISHED = 2048
MAX_ERRORS = 20
MAX_MESSAGE = 300


@dataclass(frozen=True)
class Done:
    at: float  # monotonic
    worker: str
    ttft: float | None
    tokens: int


@dataclass(frozen=True)
class ErrorNote:
    at: float  # wall clock (shown to people)
    worker: str
    message: str


class Recent:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.wall = wall
        # [second, tokens generated in it], oldest first; one entry per second with tokens.
        self._tokens: deque[list[int]] = deque(maxlen=max(WINDOWS) + 1)
        self._done: deque[Done] = deque(maxlen=MAX_FINISHED)
        self.errors: deque[ErrorNote] = deque(maxlen=MAX_ERRORS)

    def tokens(self, n: int) -> None:
        second = int(self.clock())
        if self._tokens and self._tokens[-1][0] == second:
            self._tokens[-1][1] += n
        else:
            self._tokens.append([second, n])

    def finished(self, worker: str, ttft: float | None, tokens: int) -> None:
        self._done.append(Done(self.clock(), worker, ttft, tokens))

    def error(self, worker: str, message: str) -> None:
        text = " ".join(message.split())
        if len(text) > MAX_MESSAGE:
            text = text[:MAX_MESSAGE - 1] + "…"
        self.errors.append(ErrorNote(self.wall(), worker, text))

    def window(self, seconds: int) -> dict[str, Any]:
        """Tokens per second generated in the last `seconds`, and the generations finished
        in them: how many, and their median time to first token."""
        now = self.clock()
        since = int(now) - seconds
        tokens = sum(n for second, n in self._tokens if second > since)
        done = [d for d in self._done if d.at > now - seconds]
        ttfts = [d.ttft for d in done if d.ttft is not None]
        return {
            "seconds": seconds,
            "tokens_per_s": round(tokens / seconds, 2),
            "requests": len(done),
            "ttft_p50": round(statistics.median(ttfts), 4) if ttfts else None,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "windows": [self.window(s) for s in WINDOWS],
            "errors": [{"time": round(e.at, 3), "worker": e.worker, "message": e.message}
                       for e in reversed(self.errors)],
        }
