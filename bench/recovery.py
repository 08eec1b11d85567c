"""Time from SIGKILL of a worker to its next `ready`: with a cold OpenVINO compile cache
(cache folder emptied before the kill) and with it warm.

    python bench/recovery.py [--runs 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serverctl import Server


def kill_to_ready(server: Server, worker: str) -> float:
    pid = server.children()[worker]["pid"]
    start = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    server.wait_state(worker, ("ready",), timeout=600, check=lambda c: c["pid"] != pid)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "models"
        server = Server(Path(tmp), workers=[{"name": "llm", "role": "llm"}],
                        model_cache=str(cache), backoff_initial=0.0).start()
        try:
            cold, warm = [], []
            for _ in range(args.runs):
                shutil.rmtree(cache / "ov_cache", ignore_errors=True)
                cold.append(kill_to_ready(server, "llm"))
                warm.append(kill_to_ready(server, "llm"))
        finally:
            server.stop()
    print("SIGKILL -> ready again (llm worker, embedded SmolLM2 on CPU), median of "
          f"{args.runs}")
    print(f"cold compile cache: {statistics.median(cold):6.2f} s")
    print(f"warm compile cache: {statistics.median(warm):6.2f} s")


if __name__ == "__main__":
    main()
