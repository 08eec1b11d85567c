"""The model's weight files let go of once the CPU plugin has its own copy.

OpenVINO maps an IR's `.bin` file (ENABLE_MMAP, the default) and the pipeline keeps the
ov.Model's constants, so every page of that file read while compiling and on the first
inference stays resident. The CPU plugin repacks the weights of its matrix products into
buffers of its own on that first inference; from then on most of the mapped pages are never
read again, yet they count in the worker's RSS (SmolLM2: 88 MiB of a 92 MB file, next to the
plugin's 79 MiB repacked copy; bench/worker_memory.py).

`release_mapped_weights` tells the kernel to drop those pages (madvise MADV_DONTNEED on the
read-only mappings of the folder's files). Nothing is lost: a page read again (the int8 token
embedding, which the output layer reads in place) comes back from the page cache as a minor
fault, and the mappings stay. Linux only; elsewhere it does nothing.

`release_after_warm_up` does that and two more of the same kind (docs/performance.md, "Memory
of the llm worker"): the pages of the shared libraries' code (`release_code_pages`: compiling
ran code of the CPU plugin and OpenVINO that inference never runs again, SmolLM2: 113 MiB of
code resident after the warm-up, 88 once serving instead of 113), and the C heap's free pages
given back (`trim_heap`: glibc's malloc_trim, a few MiB the compilation freed).
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

MADV_DONTNEED = 4


class Region(NamedTuple):
    """One mapping of a process, from /proc/PID/smaps."""
    start: int
    end: int
    perms: str
    name: str
    rss_kib: int
    # Its pages that are the process's own: written (copy-on-write) or never file-backed.
    anon_kib: int = 0


def regions(pid: int | str = "self") -> Iterator[Region]:
    """The mappings of process `pid` with their resident KiB (Linux)."""
    head_of: list[str] | None = None
    rss = 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if "-" in head[0] and not head[0].endswith(":"):
            head_of = head
        elif head[0] == "Rss:":
            rss = int(head[1])
        elif head[0] == "Anonymous:" and head_of is not None:
            start, end = (int(x, 16) for x in head_of[0].split("-"))
            name = head_of[5] if len(head_of) > 5 else ""
            yield Region(start, end, head_of[1], name, rss, int(head[1]))
            head_of = None


def _mappings(place: Path) -> list[tuple[int, int, int]]:
    """(start, end, resident KiB) of this process's read-only mappings of the file `place`
    or of the files in the folder `place`."""
    whole = str(place.resolve())
    prefix = whole + "/"
    # NOTE: never a writable mapping: dropping a private page someone wrote would lose the
    # write (a read-only one can only have the file's own contents).
    return [(r.start, r.end, r.rss_kib) for r in regions()
            if (r.name == whole or r.name.startswith(prefix)) and "w" not in r.perms]


def _code_mappings() -> list[tuple[int, int, int]]:
    """(start, end, resident KiB) of this process's executable mappings of files whose pages
    are all the file's own."""
    # NOTE: only r-x mappings with no anonymous page: a private page the loader wrote
    # (relocations, then made read-only: RELRO) is not in the file, and dropping it would
    # lose the write. Code pages hold exactly the file's bytes.
    return [(r.start, r.end, r.rss_kib) for r in regions()
            if r.name.startswith("/") and r.perms.startswith("r-x") and r.anon_kib == 0]


def _advise_dontneed(maps: list[tuple[int, int, int]]) -> int:
    """madvise(MADV_DONTNEED) over the mappings; the resident KiB they held."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for start, end, resident in maps:
        if madvise(start, end - start, MADV_DONTNEED) == 0:
            released += resident
    return released


def release_mapped_weights(*places: str) -> int:
    """Drop the resident pages of the read-only mappings of these model files or folders'
    files; KiB dropped."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        maps = [m for place in places if place for m in _mappings(Path(place))]
    except OSError:
        return 0
    released = _advise_dontneed(maps)
    log.debug("weight files' pages released: %d MiB", released // 1024)
    return released


def release_code_pages() -> int:
    """Drop the resident pages of the shared libraries' code; KiB dropped. What runs again
    comes back from the page cache as a minor fault, once."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        maps = _code_mappings()
    except OSError:
        return 0
    return _advise_dontneed(maps)


def trim_heap() -> bool:
    """Give the C heap's free pages back to the kernel (glibc's malloc_trim)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False  # NOTE: not glibc (musl, macOS, Windows): nothing to give back this way.
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


def release_after_warm_up(*places: str) -> None:
    """After the first inference: the weight files' pages, the code that compiling ran and
    the heap that compiling freed, let go."""
    weights = release_mapped_weights(*places)
    code = release_code_pages()
    trim_heap()
    log.info("after the warm-up: weight files' pages (%d MiB) and code pages (%d MiB) "
             "released, heap trimmed", weights // 1024, code // 1024)
