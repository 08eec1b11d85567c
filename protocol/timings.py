"""Nanoseconds a worker measured for one request: part of every final frame."""

from __future__ import annotations

import msgspec


class Timings(msgspec.Struct, array_like=True):
    """Nanoseconds measured in the worker."""

    # From receipt until the request was handed to the pipeline (template, tokenize, queue).
    queue_ns: int = 0
    # From hand-over to the first generated token (prompt processing).
    prompt_ns: int = 0
    # From the first to the last generated token.
    decode_ns: int = 0
    # From receipt to the final frame.
    total_ns: int = 0
