"""Run every benchmark in this folder, one after the other (each prints its own ratios);
peers.py is left out: it needs llama.cpp's llama-server binary
(docs/performance.md) or a peer server given by URL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    failed = 0
    for script in sorted(HERE.glob("*.py")):
        if script.name in ("run_all.py", "peers.py") or script.name.startswith("_"):
            continue
        print(f"== {script.name}", flush=True)
        failed += subprocess.run([sys.executable, str(script)], check=False).returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
