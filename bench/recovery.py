"""Time from SIGKILL of a worker to its next `ready`: with a cold OpenVINO compile cache
(cache folder emptied before the kill) and with it warm, next to what the same load and
warm-up cost in-process (the floor a restart can approach: a new process must also start
Python and import OpenVINO).

    python bench/recovery.py [--runs 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
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


def in_process_load(cache: Path) -> float:
    """Seconds for the llm worker's pipeline (the IR its restarts load) to load and answer one
    token, in a fresh interpreter that has already imported OpenVINO GenAI."""
    code = f"""
import time, pathlib, openvino_genai as g
from npu_proxy.models.locate import locate
from npu_proxy.protocol.config import Config
from npu_proxy.workers.gguf_ir import loadable
cache = pathlib.Path({str(cache)!r})
path = loadable(str(locate(Config(), "smollm2:135m").path), cache)
start = time.monotonic()
s = g.SchedulerConfig(); s.enable_prefix_caching = True; s.cache_size = 1
props = {{"CACHE_DIR": str(cache / "ov_cache" / "cpu")}}
pipe = g.ContinuousBatchingPipeline(path, s, "CPU", props)
cfg = g.GenerationConfig(); cfg.max_new_tokens = 1
pipe.generate(["Hello"], [cfg])
print(time.monotonic() - start)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1])
    return float(out.stdout.strip().splitlines()[-1])


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
            inproc = [in_process_load(cache) for _ in range(args.runs)]
        finally:
            server.stop()
    print("SIGKILL -> ready again (llm worker, embedded SmolLM2 on CPU), median of "
          f"{args.runs}")
    print(f"cold compile cache: {statistics.median(cold):6.2f} s")
    print(f"warm compile cache: {statistics.median(warm):6.2f} s")
    floor = statistics.median(inproc)
    print(f"in-process load + one token (warm cache): {floor:6.2f} s")
    print(f"restart / in-process: {statistics.median(warm) / floor:.2f}x (warm), "
          f"{statistics.median(cold) / floor:.2f}x (cold)")


if __name__ == "__main__":
    main()
