"""Test fault hooks: how an engine misbehaves on purpose, switched on per worker.

`[[workers]] faults` in the configuration (protocol/config.py `FaultHooks`) turns each on;
the tests of supervision, stalls and stream gaps use them to make a real worker exit, abort,
stall, spin or freeze with the GIL held, hold a request, or skip a frame's sequence number.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
import time
from pathlib import Path

from npu_proxy.protocol.config import WorkerSpec

log = logging.getLogger(__name__)


def _hold(gate: str) -> None:
    while gate and not Path(gate).exists():
        time.sleep(0.05)


def gateway_heartbeats_held(spec: WorkerSpec) -> bool:
    """Heartbeats go to no gateway until the hold_gateway_heartbeats_until file exists."""
    gate = spec.faults.hold_gateway_heartbeats_until
    return bool(gate) and not Path(gate).exists()


class FaultInjector:
    """Test hooks, switched on explicitly per worker in the configuration."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.faults = spec.faults
        self.tokens = 0
        self._gapped: set[str] = set()
        self._spins = 0

    def gap_due(self, rid: str, tokens: int) -> bool:
        """True once per request, when its frames should skip a sequence number."""
        limit = self.faults.gap_after_tokens
        if limit is None or tokens < limit or rid in self._gapped:
            return False
        self._gapped.add(rid)
        log.error("fault hook: skipping a frame of request %s", rid)
        return True

    def hold_accept(self) -> None:
        """Block until the hold_accept_until file exists (when set)."""
        _hold(self.faults.hold_accept_until)

    def hold_start(self, shown: str) -> None:
        """Block until the hold_start_until file, or this request's file in hold_start_dir,
        exists (when set); with hold_start_prefix, only requests whose id starts with it."""
        gate = self.faults.hold_start_until
        if self.faults.hold_start_dir and shown.startswith(self.faults.hold_start_prefix):
            gate = str(Path(self.faults.hold_start_dir) / re.sub(r"[^A-Za-z0-9._-]", "_", shown))
        if gate and not Path(gate).exists():
            log.warning("fault hook: holding request_id=%s before it starts", shown)
            _hold(gate)

    def on_tokens(self, n: int, shown: str = "") -> None:
        """`n` tokens generated (by the request whose X-Request-ID is `shown`)."""
        f = self.faults
        if f.exit_on_request and shown.startswith(f.exit_on_request):
            log.error("fault hook: exiting on request_id=%s", shown)
            os._exit(3)
        if f.token_delay_seconds > 0:
            time.sleep(f.token_delay_seconds * n)
        if f.exit_after_tokens is None and f.abort_after_tokens is None and (
            f.stall_after_tokens is None and f.spin_after_tokens is None
            and f.freeze_after_tokens is None
        ):
            return
        self.tokens += n
        if f.spin_after_tokens is not None and self.tokens >= f.spin_after_tokens:
            self._spin_with_gil(f.spin_seconds)
        if f.freeze_after_tokens is not None and self.tokens >= f.freeze_after_tokens:
            log.error("fault hook: holding the GIL for good after %d tokens", self.tokens)
            # NOTE: a foreign call through PyDLL keeps the GIL: no other thread runs again.
            libc = ctypes.PyDLL(None)
            while True:
                libc.pause()
        if f.exit_after_tokens is not None and self.tokens >= f.exit_after_tokens:
            log.error("fault hook: exiting after %d tokens", self.tokens)
            os._exit(3)
        if f.abort_after_tokens is not None and self.tokens >= f.abort_after_tokens:
            log.error("fault hook: aborting after %d tokens", self.tokens)
            os.abort()
        if f.stall_after_tokens is not None and self.tokens >= f.stall_after_tokens:
            log.error("fault hook: stalling after %d tokens", self.tokens)
            while True:
                time.sleep(3600)


    def _spin_with_gil(self, seconds: float) -> None:
        """Busy on this thread for `seconds` with the GIL held throughout, spin_times times
        in all."""
        if self._spins >= self.faults.spin_times:
            return
        self._spins += 1
        log.error("fault hook: spinning %.1f s with the GIL held", seconds)
        # NOTE: a thread waiting for the GIL asks for it after one switch interval; with the
        # interval longer than the spin, none asks, so no heartbeat leaves, as in step().
        interval = sys.getswitchinterval()
        sys.setswitchinterval(seconds + 60.0)
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                pass
        finally:
            sys.setswitchinterval(interval)
        # NOTE: a thread that waited for the GIL through a native call takes it as soon as the
        # call returns (its drop request is pending); with the long interval above it asked
        # for none, so hand the GIL over here as the end of a native step would.
        time.sleep(0)
