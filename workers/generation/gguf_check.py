"""A converted GGUF's 8-bit weights checked against llama.cpp's (issue 44, point 2): Q8_0 and
Q6_K.

llama.cpp dequantizes a group of these as `step * q` (Q8_0: 32 signed 8-bit values, step d;
Q6_K: 16 values of 6 bits minus 32, step d * scale with an 8-bit scale per group). OpenVINO
GenAI's GGUF reader keeps them as a u8 matrix minus a zero point (or i8 values) times an f16
step per group: exact to the f16 rounding of each step, as measured on the
embedded SmolLM2's Q8_0 and Qwen2.5-Coder Q4_K_M's 29 Q6_K matrices. The conversion does not
take that on trust: every 8-bit matrix of the graph as GenAI made it (before the rewrite of
workers/ir_fusion.py, which agrees() checks by its logits) must be one 8-bit tensor of the file (its
rows in the file's order, or reordered as GenAI reorders attention rows), with the file's
values exactly and each step within half an f16 ulp of the file's. Otherwise the conversion
refuses to publish the IR (WrongWeights names the tensor), as the Whisper build refuses a
model that does not agree with its reference; the worker then loads the GGUF file itself, as
after any failed conversion, and its log says why. Read in chunks of rows from the mapped file, so
a large model's weights are never all in memory at once.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from npu_proxy.models.gguf import GGUFTensor, read_gguf_tensors
from npu_proxy.workers.generation.gguf_exact import through_converts

log = logging.getLogger(__name__)

Q8_0, Q6_K = 8, 14  # ggml's type numbers
# A block's bytes, its weights, the weights of one group (one step).
_LAYOUT = {Q8_0: (34, 32, 32), Q6_K: (210, 256, 16)}
CHUNK = 4096  # rows decoded at a time
# NOTE: f16 keeps 11 significant bits: a step rounded once is within 2**-11 of it, relative;
# below f16's normal range, within half its smallest step (2**-25).
RELATIVE, ABSOLUTE = 2.0 ** -11, 2.0 ** -25


class WrongWeights(RuntimeError):
    """The converted graph's 8-bit weights are not the file's: the IR is not published."""


def shape(tensor: GGUFTensor) -> tuple[int, int, int]:
    """(rows, groups, weights per group) of an 8-bit tensor."""
    _, _, group = _LAYOUT[tensor.ggml_type]
    return int(np.prod(tensor.dims[1:], dtype=np.int64)), tensor.dims[0] // group, group


def decode(buf: mmap.mmap, tensor: GGUFTensor,
           rows: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The tensor's `rows` as llama.cpp's dequantize_row_q8_0/q6_K read them: (n, groups,
    group) signed values and (n, groups) f32 steps."""
    size, weights, _ = _LAYOUT[tensor.ggml_type]
    count, _, _ = shape(tensor)
    blocks = tensor.dims[0] // weights
    whole = np.frombuffer(buf, np.uint8, count * blocks * size, tensor.offset)
    raw = whole.reshape(count, blocks, size)[rows]
    n = len(rows)
    if tensor.ggml_type == Q8_0:
        step = raw[:, :, :2].copy().view("<f2")[:, :, 0].astype(np.float32)
        return raw[:, :, 2:].copy().view(np.int8), step
    # NOTE: Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 signed scales, d (f16); the
    # 256 weights in two halves of 128, each four runs of 32 (llama.cpp's dequantize_row_q6_K).
    ql = raw[:, :, :128].reshape(n, blocks, 2, 64)
    qh = raw[:, :, 128:192].reshape(n, blocks, 2, 32)
    values = np.stack([(ql[..., :32] & 15) | ((qh & 3) << 4),
                       (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
                       (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4),
                       (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)],
                      axis=3).astype(np.int16) - 32
    scales = raw[:, :, 192:208].copy().view(np.int8).astype(np.float32)
    d = raw[:, :, 208:210].copy().view("<f2").astype(np.float32)
    return values.astype(np.int8).reshape(n, -1, 16), (d * scales).reshape(n, -1)


@dataclass
class Matrix:
    """One 8-bit weight of the graph as it computes it: `(values - zero) * scale`."""

    name: str
    values: np.ndarray[Any, Any]  # (rows, groups, group) u8 or i8
    zero: np.ndarray[Any, Any]  # broadcastable to values
    scale: np.ndarray[Any, Any]  # (rows, groups) f32

    def rows(self, at: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        zero = np.broadcast_to(self.zero, self.values.shape)[at]
        return (self.values[at].astype(np.int16) - zero).astype(np.int16), self.scale[at]


def _user(node: Any) -> Any:
    return next(t.get_node() for t in node.output(0).get_target_inputs())


def _first_input_is(node: Any, source: Any) -> bool:
    return bool(node.input_value(0).get_node().get_friendly_name() == source.get_friendly_name())


def _data(node: Any) -> np.ndarray[Any, Any]:
    node = through_converts(node)
    if node.get_type_name() != "Constant":
        raise WrongWeights(f"{node.get_friendly_name()}: an 8-bit weight's zero point or scale "
                           "is not a constant")
    return np.asarray(node.get_data())


def matrices(model: Any) -> list[Matrix]:
    """The graph's 8-bit weights of three dimensions (GenAI's form of a Q8_0 or Q6_K tensor:
    a u8 or i8 constant, convert, subtract of a zero point where it has one, multiply by a
    scale per group)."""
    import openvino as ov

    found = []
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Constant" or len(op.get_output_shape(0)) != 3 \
                or op.get_element_type() not in (ov.Type.i8, ov.Type.u8):
            continue
        before, node = op, _user(op)
        while node.get_type_name() == "Convert":
            before, node = node, _user(node)
        zero: np.ndarray[Any, Any] = np.zeros((), np.int16)
        if node.get_type_name() == "Subtract" and _first_input_is(node, before):
            zero = _data(node.input_value(1).get_node()).astype(np.int16)
            before, node = node, _user(node)
        if node.get_type_name() != "Multiply" or not _first_input_is(node, before):
            continue  # NOTE: a zero point's or scale's own constant
        scale = _data(node.input_value(1).get_node()).astype(np.float32)
        values = np.asarray(op.get_data())
        found.append(Matrix(op.get_friendly_name(), values, zero,
                            scale.reshape(values.shape[:2])))
    return found


def _chunks(count: int) -> Iterator[np.ndarray[Any, Any]]:
    for start in range(0, count, CHUNK):
        yield np.arange(start, min(start + CHUNK, count))


def _in_order(matrix: Matrix, tensor: GGUFTensor, buf: mmap.mmap) -> bool:
    first = np.arange(min(2, len(matrix.values)))
    return bool(np.array_equal(matrix.rows(first)[0], decode(buf, tensor, first)[0]))


class RowIndex:
    """Each file tensor's rows by their values (a hash of their bytes), built once and only
    for tensors a graph matrix does not hold in order."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.built: dict[str, dict[int, int]] = {}

    def of(self, tensor: GGUFTensor) -> dict[int, int]:
        if tensor.name not in self.built:
            index: dict[int, int] = {}
            for at in _chunks(shape(tensor)[0]):
                for i, row in zip(at, decode(self.buf, tensor, at)[0], strict=True):
                    index.setdefault(hash(row.tobytes()), int(i))  # NOTE: first of repeats
            self.built[tensor.name] = index
        return self.built[tensor.name]


def _file_rows(matrix: Matrix, tensor: GGUFTensor,
               index: RowIndex) -> np.ndarray[Any, Any] | None:
    """For each row of the graph's matrix, its row in the file tensor (None: not this one).
    A wrong match of a hash is caught by _verify."""
    if _in_order(matrix, tensor, index.buf):
        return np.arange(len(matrix.values))
    rows_of = index.of(tensor)
    first = matrix.rows(np.arange(1))[0][0].astype(np.int8).tobytes()
    if hash(first) not in rows_of:
        return None
    rows = []
    for at in _chunks(len(matrix.values)):
        for row in matrix.rows(at)[0].astype(np.int8):
            rows.append(rows_of.get(hash(row.tobytes()), -1))
    return np.asarray(rows) if min(rows) >= 0 else None


def _verify(matrix: Matrix, tensor: GGUFTensor, rows: np.ndarray[Any, Any],
            buf: mmap.mmap) -> None:
    for at in _chunks(len(rows)):
        values, scale = matrix.rows(at)
        expected, step = decode(buf, tensor, rows[at])
        if not np.array_equal(values, expected):
            raise WrongWeights(f"{tensor.name}: the graph's 8-bit values are not the file's")
        off = np.abs(scale - step)
        if (off > np.maximum(RELATIVE * np.abs(step), ABSOLUTE)).any():
            raise WrongWeights(f"{tensor.name}: the graph's steps differ from the file's by up "
                               f"to {float(off.max()):.3g}, more than f16 rounding")


def check_8_bit(model: Any, gguf: Path) -> tuple[int, int]:
    """Every 8-bit matrix of `model` checked against the 8-bit tensors of `gguf`: (matrices
    checked, the file's 8-bit tensors). WrongWeights if one is not the file's."""
    tensors = [t for t in read_gguf_tensors(gguf)
               if t.ggml_type in _LAYOUT and t.dims[0] % _LAYOUT[t.ggml_type][1] == 0]
    found = matrices(model)
    if not tensors and not found:
        return 0, 0
    done: set[str] = set()
    started = time.monotonic()
    with gguf.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        index = RowIndex(buf)
        for matrix in found:
            for tensor in (t for t in tensors if shape(t) == matrix.values.shape):
                rows = _file_rows(matrix, tensor, index)
                if rows is not None:
                    _verify(matrix, tensor, rows, buf)
                    done.add(tensor.name)
                    break
            else:
                raise WrongWeights(f"{matrix.name}: an 8-bit weight of the graph is no 8-bit "
                                   "tensor of the file")
    kept = sorted(t.name for t in tensors if t.name not in done)
    log.info("8-bit weights checked against the file: %d graph matrices, %d of %d tensors in "
             "%.1f s%s", len(found), len(done), len(tensors), time.monotonic() - started,
             f" (not in the graph as 8-bit: {', '.join(kept[:8])})" if kept else "")
    return len(found), len(tensors)
