"""A converted GGUF's Q4_1 weights made exactly llama.cpp's (issue 44, point 2).

llama.cpp dequantizes a Q4_1 block of 32 weights as `d * q + m` (d and m f16, q 4 bits).
OpenVINO GenAI's GGUF reader stores it as `s * (q - z)` with s = d and z a *4-bit* zero point,
round(-m / d): every block's minimum moves by up to half a quantization step. Measured on the
embedded SmolLM2-135M Q4_1 (bench/perplexity.py, GPL-3, context 512): perplexity x1.26 of
llama-perplexity's on the same file. Here each such zero point becomes the exact -m / d (f16),
from the file's own bytes; the same graph then scored within 0.3 % of llama.cpp per chunk.

Which file tensor a graph constant came from is found by its scales, which GenAI copies
unchanged (rows may be reordered: GenAI undoes llama.cpp's row permutation of the attention
query and key), and each tensor is checked before it is changed: the 4-bit values equal the
file's, and the weights the graph then computes equal a numpy dequantization of the file's
bytes to f16 rounding. A tensor that fails the check, or that no file tensor matches, keeps
GenAI's zero points (and the log says so): the conversion never publishes weights it did not
check.
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

Q4_1 = 3  # ggml's type number
BLOCK = 32
# A block: d (f16), m (f16), 16 bytes of 4-bit values (element j low nibble, j + 16 high).
Q4_1_BYTES = 20
# NOTE: an f16 zero point of at most 16 is within 2**-7 of -m / d: a weight within 1/128 of
# its block's quantization step (d) of llama.cpp's; the 4-bit one was up to 1/2 away.
STEP_TOLERANCE = 1 / 64


@dataclass
class Q41Tensor:
    """A Q4_1 tensor of the file: its (rows, blocks) d and m; its 4-bit values are read from
    the file when needed (`values`), so a large model's are never all in memory at once."""

    tensor: GGUFTensor
    d: np.ndarray[Any, Any]
    m: np.ndarray[Any, Any]

    @property
    def name(self) -> str:
        return self.tensor.name

    def _raw(self, buf: mmap.mmap) -> np.ndarray[Any, Any]:
        rows, blocks = self.d.shape
        return np.frombuffer(buf, np.uint8, rows * blocks * Q4_1_BYTES,
                             self.tensor.offset).reshape(rows, blocks, Q4_1_BYTES)

    def values(self, buf: mmap.mmap) -> np.ndarray[Any, Any]:
        """(rows, blocks, 32) 4-bit values."""
        qs = self._raw(buf)[:, :, 4:]
        return np.concatenate([qs & 15, qs >> 4], axis=2)

    @classmethod
    def read(cls, buf: mmap.mmap, tensor: GGUFTensor) -> Q41Tensor:
        rows = int(np.prod(tensor.dims[1:], dtype=np.int64))
        shaped = cls(tensor, np.zeros((rows, tensor.dims[0] // BLOCK), np.float16),
                     np.zeros(0, np.float16))
        raw = shaped._raw(buf)
        shaped.d = raw[:, :, 0:2].copy().view("<f2")[:, :, 0]
        shaped.m = raw[:, :, 2:4].copy().view("<f2")[:, :, 0]
        return shaped


def _unpack_u4(const: Any, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """A u4 constant's values (OpenVINO packs two per byte, the first in the low nibble)."""
    packed = np.asarray(const.get_data()).view(np.uint8).ravel()
    values = np.stack([packed & 15, packed >> 4], axis=-1).ravel()
    return values[: int(np.prod(shape))].reshape(shape)


def _source(node: Any) -> Any:
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
        weights, zero = (_source(op.input_value(i).get_node()) for i in range(2))
        users = [t.get_node() for t in op.output(0).get_target_inputs()]
        if len(users) != 1 or users[0].get_type_name() != "Multiply":
            continue
        scale = _source(users[0].input_value(1).get_node())
        kinds = [(n.get_type_name(), str(n.get_element_type())) for n in (weights, zero, scale)]
        u4 = ("Constant", "<Type: 'uint4_t'>")
        if kinds[0] == u4 and kinds[1] == u4 and kinds[2][0] == "Constant":
            shape = tuple(weights.get_output_shape(0))
            if len(shape) == 3 and shape[2] == BLOCK and \
                    tuple(zero.get_output_shape(0)) == (*shape[:2], 1):
                found.append(Decompression(op, weights, zero, scale))
    return found


def _rows_of(tensor: Q41Tensor, scale: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
    """For each row of `scale`, the row of `tensor` with those d values (None: not this
    tensor's scales, or a row found twice)."""
    if tensor.d.shape != scale.shape or not (tensor.d == scale[0]).all(axis=1).any():
        return None
    index = {row.tobytes(): i for i, row in enumerate(tensor.d)}
    if len(index) != len(tensor.d):
        return None  # NOTE: two rows with the same scales: the order cannot be told
    rows = [index.get(row.tobytes(), -1) for row in scale]
    if min(rows) < 0:
        return None
    return np.asarray(rows)


def _exact(found: Decompression, tensor: Q41Tensor, rows: np.ndarray[Any, Any],
           buf: mmap.mmap) -> np.ndarray[Any, Any] | None:
    """The exact f16 zero points of one graph constant, or None if the check fails."""
    shape = tuple(found.weights.get_output_shape(0))
    q = _unpack_u4(found.weights, shape)
    if not np.array_equal(q, tensor.values(buf)[rows]):
        log.warning("%s: the graph's 4-bit values are not the file's", tensor.name)
        return None
    d = tensor.d[rows].astype(np.float32)
    m = tensor.m[rows].astype(np.float32)
    safe = np.where(d == 0, 1.0, d)
    zero = np.where(d == 0, 0.0, -m / safe).astype(np.float16)
    expected = d[:, :, None] * q + m[:, :, None]
    got = (q - zero.astype(np.float32)[:, :, None]) * d[:, :, None]
    # NOTE: a block whose d is 0 is m alone, which s * (q - z) cannot give: such a tensor
    # keeps GenAI's zero points.
    worst = float((np.abs(got - expected) / np.abs(safe)[:, :, None]).max())
    if worst > STEP_TOLERANCE or bool((d == 0).any() and (m != 0).any()):
        log.warning("%s: exact zero points off by %.3g of a step; kept as converted",
                    tensor.name, worst)
        return None
    return zero[:, :, None]


def exact_zero_points(model: Any, gguf: Path) -> int:
    """Replace the u4 zero points of `model`'s Q4_1 weights by the exact ones from `gguf`
    (checked); the number of constants replaced."""
    import openvino as ov

    tensors = [t for t in read_gguf_tensors(gguf) if t.ggml_type == Q4_1]
    if not tensors:
        return 0
    replaced = 0
    with gguf.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        file_tensors = [Q41Tensor.read(buf, t) for t in tensors]
        for found in _decompressions(model):
            scale = np.asarray(found.scale.get_data()).astype(np.float16)
            scale = scale.reshape(scale.shape[0], -1)
            for tensor in file_tensors:
                rows = _rows_of(tensor, scale)
                if rows is None:
                    continue
                zero = _exact(found, tensor, rows, buf)
                if zero is not None:
                    # NOTE: kept behind a Convert, as GenAI's was, so the decompression keeps
                    # the shape workers/ir_fusion.py and the CPU plugin recognise.
                    const = ov.opset13.convert(ov.op.Constant(zero),
                                               found.subtract.get_input_element_type(1))
                    found.subtract.input(1).replace_source_output(const.output(0))
                    replaced += 1
                break
    unmatched = len(tensors) - replaced
    log.info("Q4_1 zero points made exact: %d of %d tensors%s", replaced, len(tensors),
             f" ({unmatched} kept as converted)" if unmatched else "")
    return replaced
