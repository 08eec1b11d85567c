"""File names every platform reads the same way, checked on every platform.

A model's folder, a repository file's path: written here on Linux, the same cache may be
read on Windows (the main NPU host), where some names are not what they look like: `CON`,
`NUL.txt` or `com1.json` open a device, `a.bin:x` writes an alternate data stream of `a.bin`,
and `name.` or `name ` is silently `name`, so two names would share one file.
"""

from __future__ import annotations

# Windows' reserved device names (any case, with any extension); the superscript digits
# count too.
RESERVED = frozenset(
    {"con", "prn", "aux", "nul", "conin$", "conout$"}
    | {f"{dev}{n}" for dev in ("com", "lpt") for n in (*"123456789", "¹", "²", "³")})
# Not allowed in a Windows file name (':' also names a stream); '/' separates components.
FORBIDDEN = frozenset('<>:"|?*\\')


def component_problem(name: str) -> str | None:
    """Why `name` (one path component) is not portable, or None when it is."""
    if not name:
        return "an empty name"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "a control character"
    bad = sorted(FORBIDDEN.intersection(name))
    if bad:
        return f"the character {bad[0]!r}" + (" (an alternate data stream)"
                                               if bad[0] == ":" else "")
    if name[-1] in ". ":
        return "a trailing dot or space"
    if name.split(".", 1)[0].rstrip(" ").lower() in RESERVED:
        return "a reserved device name on Windows"
    return None


def path_problem(path: str) -> str | None:
    """Why a `/`-separated relative path is not portable, or None (`.`/`..` are the
    caller's: they are containment, not naming)."""
    for part in path.split("/"):
        if part in (".", ".."):
            continue
        problem = component_problem(part)
        if problem is not None:
            return f"{part!r} has {problem}"
    return None
