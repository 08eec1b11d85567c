"""The llm worker's memory by mapping, step by step, in fresh processes per configuration.

Each process loads the worker's own BatchEngine on a model (a GGUF converted once to IR in the
model cache), warms it up (which ends with the release of the weight files' and code pages),
then runs --plan: `L` a ~1,000-token prompt (fresh words, the same in every process) with 64
new tokens, `1` one short prompt with 64, `8` eight with 32 each (greedy, EOS ignored). Before
each step the peak (VmHWM) is reset (`/proc/self/clear_refs`); after it a row of MiB from
/proc/self/smaps: rss, hwm; heap ([heap], the main arena); big (anonymous mappings >= 64 MiB:
the KV cache's region, the plugin's big buffers); arenas (anonymous 1-64 MiB: the threads'
malloc arenas); model.bin (resident pages of the mapped weights); code (r-x file mappings).
Configurations (--steps: 0 = a whole prompt per step; N = workers.max_batch_tokens; or
--configs, `;`-separated, each of space-separated `steps:N`, `env:KEY=VALUE` (the process's
environment, e.g. glibc's MALLOC_ARENA_MAX) and `prop:KEY=VALUE` (an OpenVINO property), `-`
for none) alternate per pair (A B, B A, ...); the generated ids of each are compared with the
first's.

    python bench/memory_by_mapping.py --steps 0,512 --pairs 3
        --gguf ~/.cache/npu-proxy-test/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    python bench/memory_by_mapping.py --configs "-;env:MALLOC_ARENA_MAX=2" --plan 8 --gguf ...
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

MODELS = Path(os.environ.get("NPX_BENCH_MODELS",
                             Path.home() / ".cache" / "npu-proxy-test" / "models"))
KEYS = ("rss", "hwm", "heap", "big", "arenas", "model.bin", "code")
WORDS = ["apple", "river", "stone", "cloud", "lamp", "table", "green", "music", "paper",
         "window", "quiet", "orange", "tiger", "harbor", "candle", "winter", "garden", "silver",
         "mountain", "letter"]
SHORT = ("Write a Python function that returns the n-th Fibonacci number, with a docstring and "
         "type hints, and explain it.")


def by_mapping() -> dict[str, int]:
    """KiB resident per kind of mapping of this process, with VmRSS and VmHWM."""
    out: dict[str, int] = defaultdict(int)
    name = perms = ""
    size = rss = 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if "-" in head[0] and not head[0].endswith(":"):
            start, end = (int(x, 16) for x in head[0].split("-"))
            name, perms, size = (head[5] if len(head) > 5 else ""), head[1], (end - start) // 1024
        elif head[0] == "Rss:":
            rss = int(head[1])
            if name.endswith("openvino_model.bin"):
                out["model.bin"] += rss
            elif name == "[heap]":
                out["heap"] += rss
            elif name.startswith("/"):
                out["code" if "x" in perms else "data"] += rss
            elif not name:
                out["big" if size >= 65536 else "arenas" if size >= 1024 else "small"] += rss
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out["rss" if line.startswith("VmRSS") else "hwm"] = int(line.split()[1])
    return out


def child(args: argparse.Namespace) -> None:
    import openvino as ov

    from npu_proxy.protocol.config import WorkerSpec
    from npu_proxy.protocol.messages import SamplingParams
    from npu_proxy.workers.batch_engine import BatchEngine
    from npu_proxy.workers.generation.sampling import generation_config
    from npu_proxy.workers.gguf_ir import loadable

    path = loadable(args.gguf, MODELS)
    spec = WorkerSpec(name="llm", max_batch_tokens=args.step, kv_cache_gb=args.kv_gb)
    engine = BatchEngine(spec, path, args.context, lambda frame: None)
    engine.load(json.loads(args.props))
    engine.warm_up()
    assert engine.prompting is not None
    rows: list[dict[str, Any]] = [{"step": "idle", **by_mapping()}]
    rng = random.Random(7)
    short = engine.prompting.encode(SHORT)
    ids: dict[str, list[list[int]]] = {}
    for i, what in enumerate(args.plan.split(",")):
        if what == "L":
            prompts = [engine.prompting.encode(" ".join(rng.choice(WORDS) for _ in range(1000)))]
            tokens = 64
        else:
            prompts, tokens = [short] * int(what), 64 if what == "1" else 32
        cfg = generation_config(SamplingParams(max_tokens=tokens, temperature=0.0),
                                engine.base_config, tokens)
        cfg.ignore_eos = True
        Path("/proc/self/clear_refs").write_text("5")  # NOTE: VmHWM := VmRSS, a step's peak
        start, first = time.perf_counter(), 0.0
        handles = [engine.pipe.add_request(1000 + j, ov.Tensor(p), cfg)
                   for j, p in enumerate(prompts)]
        while engine.pipe.has_non_finished_requests():
            engine.pipe.step()
            if not first and handles[0].can_read():
                first = time.perf_counter() - start
        outs = [h.read_all() for h in handles]
        seconds = time.perf_counter() - start
        ids[f"{i}:{what}"] = [list(o[0].generated_ids) for o in outs]
        rows.append({"step": what, "ttft": first, "tok_s": tokens * len(prompts) / seconds,
                     "kv_pct": engine.pipe.get_metrics().max_cache_usage, **by_mapping()})
    print(json.dumps({"rows": rows, "ids": ids, "load": os.getloadavg()[0]}))


def parse_config(config: str, default_step: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    """(steps, environment, properties) of one --configs item."""
    step, env, props = int(default_step), {}, {}
    for item in config.split():
        kind, _, rest = item.partition(":")
        key, _, value = rest.partition("=")
        if kind == "steps":
            step = int(rest)
        elif kind == "env":
            env[key] = value
        elif kind == "prop":
            props[key] = int(value) if value.lstrip("-").isdigit() else value
        elif item != "-":
            raise SystemExit(f"unknown configuration item {item!r}")
    return step, env, props


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--steps", default="0,512")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--plan", default="L,1,8")
    parser.add_argument("--kv-gb", type=float, default=1.0)
    parser.add_argument("--context", type=int, default=32768,
                        help="the model's context (the step limit when --steps has 0)")
    parser.add_argument("--configs", default="",
                        help="`;`-separated configurations (steps:N env:K=V prop:K=V, - none)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--props", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--step", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    configs = (args.configs.split(";") if args.configs
               else [f"steps:{s}" for s in args.steps.split(",")])
    first: dict[str, Any] | None = None
    print("MiB; " + " ".join(KEYS))
    for pair in range(args.pairs):
        for config in configs if pair % 2 == 0 else configs[::-1]:
            step, env, props = parse_config(config, args.steps.split(",")[-1])
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--gguf", args.gguf, "--step", str(step),
                 "--plan", args.plan, "--kv-gb", str(args.kv_gb), "--context",
                 str(args.context), "--props", json.dumps(props)], check=True,
                capture_output=True, text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore", **env}).stdout
            result = json.loads(out.strip().splitlines()[-1])
            first = first or result
            same = result["ids"] == first["ids"]
            print(f"pair {pair + 1}, {config} (steps {step or 'whole prompt'}), load "
                  f"{result['load']:.1f}, ids same as the first process: {same}")
            for row in result["rows"]:
                speed = (f"  TTFT {row['ttft'] * 1000:.0f} ms, {row['tok_s']:.1f} tok/s, KV "
                         f"{row['kv_pct']:.2f} %" if "ttft" in row else "")
                print(f"  {row['step']:5s}" + "".join(f"{row.get(k, 0) / 1024:8.0f}"
                                                     for k in KEYS) + speed, flush=True)


if __name__ == "__main__":
    main()
