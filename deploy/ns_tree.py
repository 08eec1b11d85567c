"""Make `build/ns/npu_proxy/<folder>` links to the repository's top-level packages.

The wheel installs `gateway/`, `workers/`... as `npu_proxy.gateway`, `npu_proxy.workers`...
(pyproject.toml `package-dir`). Editable installs find them through setuptools' import
finder, which tools that read files rather than import (mypy, PyInstaller's analysis) do not
run; they read this tree instead. Run with no arguments; prints the tree's root.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "models", "protocol", "supervisor", "workers")


def make(root: Path = ROOT) -> Path:
    tree = root / "build" / "ns"
    namespace = tree / "npu_proxy"
    namespace.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        link = namespace / name
        target = Path(os.path.relpath(root / name, namespace))
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
    return tree


if __name__ == "__main__":
    sys.stdout.write(f"{make()}\n")
