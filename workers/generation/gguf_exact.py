"""A converted GGUF's 4-bit weights made exactly llama.cpp's (issue 44, point 2): Q4_1 and
Q4_K; Q4_0's checked.

llama.cpp dequantizes a group of 32 weights as `step * q + offset` (q 4 bits; Q4_0: step d,
offset -8 d; Q4_1: step d, offset m; Q4_K: step d * scale, offset -dmin * min, with 6-bit
scales and minimums per group). OpenVINO GenAI's GGUF reader stores it as `s * (q - z)` with s
the step and z a *4-bit* zero point, round(-offset / s): every group's offset moves by up to
half a step. Measured on the embedded SmolLM2-135M Q4_1 (bench/perplexity.py, GPL-3, context
512): perplexity x1.26 of llama-perplexity's on the same file. Here each such zero point
becomes the exact -offset / s (f16), from the file's own bytes; the same graph then scored
within 0.3 % of llama.cpp. Q4_0's zero point, 8, is exact already: it goes through the same
check (and comes out the same).

Which file tensor a graph constant came from is found by its scales (GenAI's step, rounded
to f16 as the graph holds it; rows may be reordered: GenAI undoes llama.cpp's row
permutation of the attention query and key), and each tensor is checked before it is
changed: the 4-bit values equal the file's, and the weights the graph then computes equal a
numpy dequantization of the file's bytes within 1/64 of a step. A tensor that fails the
check, or that no file tensor matches, keeps GenAI's zero points (and the log says so): the
conversion never publishes weights it did not check.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from npu_proxy.models.gguf import GGUFTensor, read_gguf_tensors

log = logging.getLogger(__name__)

Q4_0, Q4_1, Q4_K = 2, 3, 12  # ggml's type numbers
BLOCK = 32


@dataclass
class FileTensor:
    """A 4-bit tensor of the file as llama.cpp dequantizes it, per group of 32 weights:
    `step * q + offset`. `key` is the step as the graph's scale constant holds it (f16),
    which finds the tensor's rows in a graph; the 4-bit values are read from the file when
    needed (`values`), so a large model's are never all in memory at once."""

    tensor: GGUFTensor
    step: np.ndarray[Any, Any]  # (rows, groups) f32
    offset: np.ndarray[Any, Any]  # (rows, groups) f32
    key: np.ndarray[Any, Any]  # (rows, groups) f16

    @property
    def name(self) -> str:
        return self.tensor.name

    def values(self, buf: mmap.mmap) -> np.ndarray[Any, Any]:
        """(rows, groups, 32) 4-bit values."""
        raw = _raw(buf, self.tensor)
        if self.tensor.ggml_type in (Q4_0, Q4_1):
            qs = raw[:, :, 2 if self.tensor.ggml_type == Q4_0 else 4:]
            return np.concatenate([qs & 15, qs >> 4], axis=2)
        # NOTE: Q4_K: 4 chunks of 32 bytes per 256 weights; a chunk's low nibbles are one
        # group of 32, its high nibbles the next.
        qs = raw[:, :, 16:].reshape(raw.shape[0], raw.shape[1], 4, 1, BLOCK)
        return np.concatenate([qs & 15, qs >> 4], axis=3).reshape(raw.shape[0], -1, BLOCK)


# A block's bytes and weights: Q4_0 d (f16) and Q4_1 d, m (f16), then 16 bytes of 4-bit
# values (element j the low nibble, j + 16 the high), 32 weights; Q4_K d, dmin (f16), 12 bytes
# of 6-bit group scales and minimums, 128 bytes of 4-bit values, 256 weights.
_LAYOUT = {Q4_0: (18, 32), Q4_1: (20, 32), Q4_K: (144, 256)}


def _raw(buf: mmap.mmap, tensor: GGUFTensor) -> np.ndarray[Any, Any]:
    size, weights = _LAYOUT[tensor.ggml_type]
    rows = int(np.prod(tensor.dims[1:], dtype=np.int64))
    blocks = tensor.dims[0] // weights
    return np.frombuffer(buf, np.uint8, rows * blocks * size,
                         tensor.offset).reshape(rows, blocks, size)


def _f16(raw: np.ndarray[Any, Any], at: int) -> np.ndarray[Any, Any]:
    return raw[:, :, at:at + 2].copy().view("<f2")[:, :, 0].astype(np.float32)


def _k4_scales(raw: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Q4_K's 8 group scales and minimums per block (6 bits each, llama.cpp's
    get_scale_min_k4)."""
    b = raw[:, :, 4:16].astype(np.uint8)
    low = [(b[:, :, j] & 63, b[:, :, j + 4] & 63) for j in range(4)]
    high = [((b[:, :, j + 4] & 15) | ((b[:, :, j - 4] >> 6) << 4),
             (b[:, :, j + 4] >> 4) | ((b[:, :, j] >> 6) << 4)) for j in range(4, 8)]
    pairs = low + high
    return (np.stack([p[0] for p in pairs], axis=2).astype(np.float32),
            np.stack([p[1] for p in pairs], axis=2).astype(np.float32))


def read_tensor(buf: mmap.mmap, tensor: GGUFTensor) -> FileTensor:
    raw = _raw(buf, tensor)
    rows = raw.shape[0]
    if tensor.ggml_type == Q4_0:
        step = _f16(raw, 0)
        offset = -8 * step
    elif tensor.ggml_type == Q4_1:
        step, offset = _f16(raw, 0), _f16(raw, 2)
    else:
        scales, mins = _k4_scales(raw)
        step = (_f16(raw, 0)[:, :, None] * scales).reshape(rows, -1)
        offset = -(_f16(raw, 2)[:, :, None] * mins).reshape(rows, -1)
    return FileTensor(tensor, step, offset, step.astype(np.float16))


def _unpack_u4(const: Any, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """A u4 constant's values (OpenVINO packs two per byte, the first in the low nibble)."""
    packed = np.asarray(const.get_data()).view(np.uint8).ravel()
    values = np.stack([packed & 15, packed >> 4], axis=-1).ravel()
    return values[: int(np.prod(shape))].reshape(shape)


def through_converts(node: Any) -> Any:
    while node.get_type_name() == "Convert":
        node = node.input_value(0).get_node()
    return node


@dataclass
class Decompression:
    """A graph's `(convert(q) - convert(z)) * s` of a u4 weight with a u4 zero point."""

    subtract: Any
    weights: Any  # Constant u4 (rows, blocks, 32)
    zero: Any  # Constant u4 (rows, blocks, 1)
    scale: Any  # Constant f16 (rows, blocks, 1)


def _decompressions(model: Any) -> list[Decompression]:
    found = []
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Subtract":
            continue
        weights, zero = (through_converts(op.input_value(i).get_node()) for i in range(2))
        users = [t.get_node() for t in op.output(0).get_target_inputs()]
        if len(users) != 1 or users[0].get_type_name() != "Multiply":
            continue
        scale = through_converts(users[0].input_value(1).get_node())
        kinds = [(n.get_type_name(), str(n.get_element_type())) for n in (weights, zero, scale)]
        u4 = ("Constant", "<Type: 'uint4_t'>")
        if kinds[0] == u4 and kinds[1] == u4 and kinds[2][0] == "Constant":
            shape = tuple(weights.get_output_shape(0))
            if len(shape) == 3 and shape[2] == BLOCK and \
                    tuple(zero.get_output_shape(0)) == (*shape[:2], 1):
                found.append(Decompression(op, weights, zero, scale))
    return found


def _rows_of(tensor: FileTensor, scale: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
    """For each row of `scale`, the row of `tensor` with those scales (None: not this
    tensor's scales, or a row found twice)."""
    if tensor.key.shape != scale.shape or not (tensor.key == scale[0]).all(axis=1).any():
        return None
    if np.array_equal(tensor.key, scale):
        return np.arange(len(scale))  # NOTE: in order (an embedding may repeat a row)
    index = {row.tobytes(): i for i, row in enumerate(tensor.key)}
    if len(index) != len(tensor.key):
        return None  # NOTE: two rows with the same scales: the order cannot be told
    rows = [index.get(row.tobytes(), -1) for row in scale]
    if min(rows) < 0:
        return None
    return np.asarray(rows)


@dataclass
class Exact:
    """What makes one graph constant exact: its zero points, and where a group's step is 0
    with an offset (a group of equal weights, which `s * (q - z)` with s = 0 cannot give),
    new 4-bit values and scales for it (q 0, s the offset, z -1)."""

    zero: np.ndarray[Any, Any]  # (rows, groups, 1) f16
    values: np.ndarray[Any, Any] | None = None  # (rows, groups, 32) 0-15
    scale: np.ndarray[Any, Any] | None = None  # (rows, groups, 1) f16


def _exact(found: Decompression, tensor: FileTensor, rows: np.ndarray[Any, Any],
           buf: mmap.mmap) -> Exact | None:
    """The exact form of one graph constant, or None if the check fails."""
    shape = tuple(found.weights.get_output_shape(0))
    q = _unpack_u4(found.weights, shape)
    if not np.array_equal(q, tensor.values(buf)[rows]):
        log.warning("%s: the graph's 4-bit values are not the file's", tensor.name)
        return None
    step, offset = tensor.step[rows], tensor.offset[rows]
    scale = tensor.key[rows].astype(np.float32)  # NOTE: what the graph multiplies by
    dead = (scale == 0) & (offset != 0)
    if dead.any():
        q = np.where(dead[:, :, None], 0, q).astype(np.uint8)
        scale = np.where(dead, offset.astype(np.float16).astype(np.float32), scale)
    safe = np.where(scale == 0, 1.0, scale)
    zero = np.where(dead, -1.0, np.where(scale == 0, 0.0, -offset / safe)).astype(np.float16)
    expected = step[:, :, None] * q + offset[:, :, None]
    got = (q - zero.astype(np.float32)[:, :, None]) * scale[:, :, None]
    # NOTE: each weight within 1/64 of its group's step of llama.cpp's, beside the rounding
    # f16 cannot avoid: of a large zero point (an offset of many steps: Qwen2.5-Coder's
    # blk.2.ffn_down has some, which GenAI's 4-bit zero point clamps at 15), of a step below
    # f16's normal range (the graph's scale is f16), of a dead group's offset.
    z = np.abs(zero.astype(np.float32))
    allowed = (np.abs(step) * (1 / 64 + z / 1024)
               + np.where(dead, np.abs(offset) / 1024, 16 * np.abs(scale - step)))
    worst = float((np.abs(got - expected) / np.maximum(allowed, 1e-30)[:, :, None]).max())
    if worst > 1:
        log.warning("%s: exact zero points off by x%.3g of what f16 rounding allows; kept as "
                    "converted", tensor.name, worst)
        return None
    if not dead.any():
        return Exact(zero[:, :, None])
    return Exact(zero[:, :, None], q, scale.astype(np.float16)[:, :, None])


def _already(found: Decompression, exact: Exact) -> bool:
    """The graph computes the exact weights as it is (Q4_0's zero point 8)."""
    if exact.values is not None or exact.scale is not None:
        return False
    zero = _unpack_u4(found.zero, tuple(found.zero.get_output_shape(0)))
    return bool(np.array_equal(zero.astype(np.float32), exact.zero.astype(np.float32)))


def _u4_constant(values: np.ndarray[Any, Any]) -> Any:
    """A u4 constant of `values` (0-15), packed two per byte, the first in the low nibble."""
    import openvino as ov

    flat = values.astype(np.uint8).ravel()
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    tensor = ov.Tensor(ov.Type.u4, ov.Shape(list(values.shape)))
    tensor.data[:] = flat[0::2] | (flat[1::2] << 4)
    return ov.op.Constant(tensor)


def _apply(found: Decompression, exact: Exact) -> None:
    import openvino as ov

    # NOTE: kept behind a Convert, as GenAI's was, so the decompression keeps the shape
    # workers/ir_fusion.py and the CPU plugin recognise.
    zero = ov.opset13.convert(ov.op.Constant(exact.zero),
                              found.subtract.get_input_element_type(1))
    found.subtract.input(1).replace_source_output(zero.output(0))
    if exact.values is not None:
        found.weights.output(0).replace(_u4_constant(exact.values).output(0))
    if exact.scale is not None:
        kind = found.scale.get_output_element_type(0)
        scale = ov.op.Constant(exact.scale.astype(np.float16))
        if kind != ov.Type.f16:
            scale = ov.opset13.convert(scale, kind)
        found.scale.output(0).replace(scale.output(0))


def exact_zero_points(model: Any, gguf: Path) -> int:
    """Replace the u4 zero points of `model`'s Q4_0, Q4_1 and Q4_K weights by the exact ones
    from `gguf` (checked); the number of constants replaced."""
    tensors = [t for t in read_gguf_tensors(gguf)
               if t.ggml_type in _LAYOUT and t.dims[0] % _LAYOUT[t.ggml_type][1] == 0]
    if not tensors:
        return 0
    replaced = 0
    done: set[str] = set()
    with gguf.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        file_tensors = [read_tensor(buf, t) for t in tensors]
        for found in _decompressions(model):
            scale = np.asarray(found.scale.get_data()).astype(np.float16)
            scale = scale.reshape(scale.shape[0], -1)
            for tensor in file_tensors:
                rows = _rows_of(tensor, scale)
                if rows is None:
                    continue
                exact = _exact(found, tensor, rows, buf)
                if exact is not None:
                    done.add(tensor.name)
                    if not _already(found, exact):
                        _apply(found, exact)
                        replaced += 1
                break
    kept = sorted(t.name for t in tensors if t.name not in done)
    log.info("4-bit weights checked against the file: %d of %d tensors, %d zero points made "
             "exact%s", len(done), len(tensors), replaced,
             f" (kept as converted: {', '.join(kept[:8])})" if kept else "")
    return replaced
