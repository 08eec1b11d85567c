"""The ids and timestamps the APIs hand out: requests, completions, messages, tool calls."""

from __future__ import annotations

import time
import uuid


def new_id(prefix: str = "") -> str:
    """A fresh id: `prefix` and 24 hex digits of a random UUID."""
    return prefix + uuid.uuid4().hex[:24]


def now() -> int:
    """The time in whole seconds, as the APIs' `created` fields carry it."""
    return int(time.time())
