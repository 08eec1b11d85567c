"""The real-time-factor table of the speech benchmarks (bench/asr.py, bench/tts.py): seconds
of work per second of audio, through the server and in-process, medians over rounds."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from typing import TypeVar

Case = TypeVar("Case")
# One run of a case: (seconds of work, seconds of audio).
Run = Callable[[Case], tuple[float, float]]


def rtf_table(cases: Iterable[Case], rounds: int, over_http: Run[Case],
              in_process: Run[Case]) -> None:
    """Print, per case, the audio's length, both real-time factors and their ratio. Both
    sides take turns per round, so load from other processes falls on both alike."""
    print(f"{'audio s':>9} {'RTF http':>9} {'RTF in-proc':>12} {'http/in-proc':>13}")
    for case in cases:
        over_http(case)  # NOTE: warm both sides once per case
        in_process(case)
        http, local = [], []
        seconds = 0.0
        for _ in range(rounds):
            took, seconds = over_http(case)
            http.append(took / seconds)
            took, length = in_process(case)
            local.append(took / length)
        h, p = statistics.median(http), statistics.median(local)
        print(f"{seconds:9.1f} {h:9.3f} {p:12.3f} {h / p:13.2f}", flush=True)
