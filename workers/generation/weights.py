"""The model's weight files let go of once the CPU plugin has its own copy.

OpenVINO maps an IR's `.bin` file (ENABLE_MMAP, the default) and the pipeline keeps the
ov.Model's constants, so every page of that file read while compiling and on the first
inference stays resident. The CPU plugin repacks the weights of its matrix products into
buffers of its own on that first inference; from then on most of the mapped pages are never
read again, yet they count in the worker's RSS (SmolLM2: 88 MiB of a 92 MB file, next to the
plugin's 79 MiB repacked copy; bench/worker_memory.py).

`release_mapped_weights` tells the kernel to drop those pages (madvise MADV_DONTNEED on the
read-only mappings of the folder's files). Nothing is lost: a page read again (the token
embedding, which the Gather reads in place) comes back as a fault, and the mappings stay.
`read_back_by_page`, once the first request has run, drops again the ranges that came back and
takes them out of the page cache, so that from then on they come back one 4 KiB page at a
time, not a page-cache folio at a time. Linux only; elsewhere these do nothing.

`release_after_warm_up` does that and two more of the same kind (docs/performance.md, "Memory
of the llm worker"): the pages of the shared libraries' code (`release_code_pages`: compiling
ran code of the CPU plugin and OpenVINO that inference never runs again, SmolLM2: 113 MiB of
code resident after the warm-up, 88 once serving instead of 113), and the C heap's free pages
given back (`trim_heap`: glibc's malloc_trim, a few MiB the compilation freed).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

MADV_RANDOM = 1
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
    # Where in the file it starts (bytes).
    offset: int = 0


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
            yield Region(start, end, head_of[1], name, rss, int(head[1]), int(head_of[2], 16))
            head_of = None


def _mappings(place: Path) -> list[Region]:
    """This process's read-only mappings of the file `place` or of the files in the folder
    `place`."""
    whole = str(place.resolve())
    prefix = whole + "/"
    # NOTE: never a writable mapping: dropping a private page someone wrote would lose the
    # write (a read-only one can only have the file's own contents).
    return [r for r in regions()
            if (r.name == whole or r.name.startswith(prefix)) and "w" not in r.perms]


def _code_mappings() -> list[tuple[int, int, int]]:
    """(start, end, resident KiB) of this process's executable mappings of files whose pages
    are all the file's own."""
    # NOTE: only r-x mappings with no anonymous page: a private page the loader wrote
    # (relocations, then made read-only: RELRO) is not in the file, and dropping it would
    # lose the write. Code pages hold exactly the file's bytes.
    return [(r.start, r.end, r.rss_kib) for r in regions()
            if r.name.startswith("/") and r.perms.startswith("r-x") and r.anon_kib == 0]


def _advise(maps: list[tuple[int, int, int]], advice: int = MADV_DONTNEED) -> int:
    """madvise(advice) over the mappings; the resident KiB of those it was given to."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for start, end, resident in maps:
        if madvise(start, end - start, advice) == 0:
            released += resident
    return released


def _evict_for_paging(maps: list[Region]) -> None:
    """Make what is read again of these (released) file mappings come back 4 KiB at a time:
    no readahead on them, and their ranges out of the page cache.

    NOTE: a fault maps the whole page-cache folio it lands in (Linux 6.18; fault-around maps
    64 KiB on older kernels), and a file written in large writes (a conversion, an install)
    is cached in folios of up to 2 MiB: the rows of Qwen2.5-Coder-1.5B's token embedding
    that the Gather read kept 107-109 MiB of the file resident at 8 streams, 3 once these
    ranges were evicted and read by page (docs/performance.md, "Page-cache folios"). Only
    the ranges read in place: the whole file is mapped, and evicting it all would make the
    next start read 1.2 GB from the disk."""
    _advise([(r.start, r.end, 0) for r in maps], MADV_RANDOM)
    for r in maps:
        try:
            fd = os.open(r.name, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, r.offset, r.end - r.start, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def release_mapped_weights(*places: str) -> int:
    """Drop the resident pages of the read-only mappings of these model files or folders'
    files; KiB dropped."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        maps = [m for place in places if place for m in _mappings(Path(place))]
    except OSError:
        return 0
    released = _advise([(r.start, r.end, r.rss_kib) for r in maps])
    log.debug("weight files' pages released: %d MiB", released // 1024)
    return released


def read_back_by_page(*places: str) -> int:
    """Drop again what inference has read in place of these model files since their release
    (the token embedding's rows: only mappings with resident pages), and have it come back a
    page at a time from then on; KiB dropped."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        maps = [m for place in places if place for m in _mappings(Path(place)) if m.rss_kib]
    except OSError:
        return 0
    released = _advise([(r.start, r.end, r.rss_kib) for r in maps])
    _evict_for_paging(maps)
    log.info("weight ranges read in place: %d MiB dropped, read by page from now on",
             released // 1024)
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
    return _advise(maps)


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
