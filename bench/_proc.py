"""What the benchmarks read of a process from /proc (Linux): its resident memory."""

from __future__ import annotations

import os
from pathlib import Path

PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


def rss_kib(pid: int | str = "self") -> int:
    """Resident KiB of process `pid` now (0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_KIB
    except (OSError, IndexError, ValueError):
        return 0
