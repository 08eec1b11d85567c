"""Lossless rewrites of a GGUF model's OpenVINO graph that make a CPU decode step cheaper.

OpenVINO GenAI turns each quantized GGUF matrix into a compressed-weight pattern (integer
weights, a zero point and a scale per group, multiplied out on the fly) and gives every
projection its own matrix product. A decode step of a small model is mostly those products'
fixed costs (each one quantizes its activations again, walks its own groups, syncs its
threads), so:

- the products that read the same tensor and feed only layout ops (attention's q, k and v) are
  merged into one product over the weights stacked by rows, then split: the same weights,
  groups, scales and zero points, so the same numbers row by row, in f32 and in bf16 (checked
  bit for bit in tests/test_gguf_ir.py) with 151 products per step instead of 211 for SmolLM2.
  Products that feed layout ops through a constant bias Add (Qwen2.5's q, k and v) are merged
  the same way with their biases concatenated into one Add, in groups of one kind of weights
  (Qwen2.5's v is Q6_K in half the layers, so there q and k only).
  The MLP's gate and up stay apart: the CPU plugin computes the gate's Swish on the product's
  f32 accumulator, and merged it would run on bf16-rounded values (issue 28);
- an 8-bit matrix whose zero point is one value everywhere (128: how a symmetric Q8_0 GGUF
  tensor is loaded, SmolLM2's output layer; 32: a Q6_K tensor, Qwen2.5's attn_v, ffn_down and
  output layer) becomes signed 8-bit without a zero point: the same values, and the CPU plugin
  then subtracts one constant instead of reading a zero point per group of 16 or 32.

Measured on the embedded SmolLM2 (bench/levers.py): a decode step ~12 % shorter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import openvino as ov
from openvino import opset13 as ops

log = logging.getLogger(__name__)

_PACKED = (ov.Type.u4, ov.Type.i4)
# NOTE: a product whose output goes anywhere else may be fused by the CPU plugin with what
# follows it (the gate's Swish becomes a post-op computed on the f32 accumulator); merged, the
# product's output is rounded to the inference precision (bf16) before that op instead, which
# changes bf16 numbers (issue 28). These ops only move elements, so nothing is lost.
_LAYOUT_ONLY = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Transpose"})


@dataclass
class Compressed:
    """A matrix product's weight input: Convert(weights) - Convert(zero point), times scale,
    then Reshape/Convert nodes (`tail`, from the weights' side) into the product."""

    weights: Any
    zero: Any
    scale: Any
    multiply: Any
    to_float: Any  # the Convert of the weights (its type is the decompression's)
    tail: list[Any] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return int(self.weights.get_output_shape(0)[0])

    def kind(self) -> tuple[Any, ...]:
        """What must agree for matrices to be stacked: types, and every dimension but rows."""
        return (self.weights.get_output_element_type(0), self.zero.get_output_element_type(0),
                self.scale.get_output_element_type(0), self.to_float.get_output_element_type(0),
                tuple(self.weights.get_output_shape(0))[1:],
                tuple(self.zero.get_output_shape(0))[1:],
                tuple(self.scale.get_output_shape(0))[1:],
                tuple((t.get_type_name(), t.get_output_element_type(0)) for t in self.tail))


def _source(node: Any, index: int = 0) -> Any:
    return node.input(index).get_source_output().get_node()


def compressed_weight(matmul: Any) -> Compressed | None:
    """The compressed-weight pattern feeding `matmul`'s second input, else None."""
    node = _source(matmul, 1)
    tail: list[Any] = []
    while node.get_type_name() in ("Convert", "Reshape"):
        tail.append(node)
        node = _source(node)
    if node.get_type_name() != "Multiply":
        return None
    sub, scale = _source(node, 0), _source(node, 1)
    if sub.get_type_name() != "Subtract" or scale.get_type_name() != "Constant":
        return None
    to_float, zero_float = _source(sub, 0), _source(sub, 1)
    if to_float.get_type_name() != "Convert" or zero_float.get_type_name() != "Convert":
        return None
    weights, zero = _source(to_float), _source(zero_float)
    if weights.get_type_name() != "Constant" or zero.get_type_name() != "Constant":
        return None
    if len(weights.get_output_shape(0)) < 2:
        return None
    return Compressed(weights, zero, scale, node, to_float, tail)


def _stack(consts: list[Any]) -> Any:
    """One constant: `consts` stacked along their first dimension."""
    kind = consts[0].get_output_element_type(0)
    shapes = [list(c.get_output_shape(0)) for c in consts]
    shape = [sum(s[0] for s in shapes), *shapes[0][1:]]
    if kind in _PACKED:
        # NOTE: two 4-bit values per byte, in the flat order of the elements, so whole
        # matrices with an even count of elements stack as their bytes do. The tensor owns
        # its buffer (one made over a NumPy array would not copy it).
        tensor = ov.Tensor(kind, ov.Shape(shape))
        tensor.data[:] = np.concatenate([np.frombuffer(c.get_data().tobytes(), dtype=np.uint8)
                                         for c in consts])
        return ov.op.Constant(tensor)
    return ops.constant(np.concatenate([c.get_data() for c in consts], axis=0))


def _even(c: Compressed) -> bool:
    return all(int(np.prod(n.get_output_shape(0))) % 2 == 0 for n in (c.weights, c.zero))


def _layout_only_users(product: Any) -> bool:
    return all(t.get_node().get_type_name() in _LAYOUT_ONLY
               for t in product.output(0).get_target_inputs())


_BIAS_TYPES = (ov.Type.f32, ov.Type.f16)


class _Bias(NamedTuple):
    """A bias Add after a product: the constant added (behind `converts`, from its side)."""

    add: Any
    side: int  # the Add's input that the product feeds
    constant: Any
    converts: tuple[Any, ...]


def _bias_add(product: Any, rows: int) -> _Bias | None:
    """The product's only consumer when it adds a constant along the last axis (Qwen2.5's
    q, k and v biases) and itself feeds only layout ops, else None."""
    users = list(product.output(0).get_target_inputs())
    if len(users) != 1 or users[0].get_node().get_type_name() != "Add":
        return None
    add, index = users[0].get_node(), users[0].get_index()
    if add.get_attributes().get("auto_broadcast") != "numpy" or not _layout_only_users(add):
        return None
    node, converts = _source(add, 1 - index), []
    while node.get_type_name() == "Convert":
        converts.append(node)
        node = _source(node)
    if node.get_type_name() != "Constant" or node.get_output_element_type(0) not in _BIAS_TYPES:
        return None
    shape = list(node.get_output_shape(0))
    rank = product.get_output_partial_shape(0).rank
    # NOTE: broadcast along the last axis only, and no wider than the product's output, so
    # the sum has the product's shape and splits along its last axis as the product does.
    if (not shape or any(d != 1 for d in shape[:-1]) or shape[-1] != rows
            or rank.is_dynamic or len(shape) > rank.get_length()):
        return None
    return _Bias(add, index, node, tuple(converts))


class _Sibling(NamedTuple):
    product: Any
    weight: Compressed
    bias: _Bias | None

    def key(self) -> tuple[Any, ...]:
        """What must agree for products to be merged: the weights' kind, and whether (and in
        which types, which rank) a bias is added."""
        if self.bias is None:
            return (self.weight.kind(), None)
        b = self.bias
        return (self.weight.kind(), b.constant.get_output_element_type(0),
                len(b.constant.get_output_shape(0)),
                tuple(c.get_output_element_type(0) for c in b.converts))


def _sibling(product: Any) -> _Sibling | None:
    weight = compressed_weight(product)
    if weight is None or product.get_transpose_a() or not product.get_transpose_b():
        return None
    if weight.weights.get_output_element_type(0) in _PACKED and not _even(weight):
        return None
    if _layout_only_users(product):
        return _Sibling(product, weight, None)
    bias = _bias_add(product, weight.rows)
    return None if bias is None else _Sibling(product, weight, bias)


def _merge(out: Any, group: list[_Sibling]) -> None:
    """One product over the group's weights stacked by rows (plus their biases concatenated),
    split back into each product's (or bias Add's) output."""
    found = [s.weight for s in group]
    first = found[0]
    decompressed = ops.multiply(
        ops.subtract(
            ops.convert(_stack([w.weights for w in found]),
                        first.to_float.get_output_element_type(0)),
            ops.convert(_stack([w.zero for w in found]),
                        first.to_float.get_output_element_type(0))),
        _stack([w.scale for w in found]))
    rows = [w.rows for w in found]
    node: Any = decompressed
    for t in reversed(first.tail):
        if t.get_type_name() == "Reshape":
            cols = int(np.prod(t.get_output_shape(0)[1:]))
            target = np.array([sum(rows), cols], dtype=np.int64)
            node = ops.reshape(node, ops.constant(target), False)
        else:
            node = ops.convert(node, t.get_output_element_type(0))
    merged: Any = ops.matmul(out, node, False, True)
    olds = [s.product for s in group]
    biases = [s.bias for s in group if s.bias is not None]
    if biases:
        bias: Any = ops.constant(np.concatenate([b.constant.get_data() for b in biases],
                                                axis=-1))
        for c in reversed(biases[0].converts):
            bias = ops.convert(bias, c.get_output_element_type(0))
        # NOTE: the same operand order as the Adds replaced (exact either way in IEEE).
        merged = ops.add(*((merged, bias) if biases[0].side == 0 else (bias, merged)))
        olds = [b.add for b in biases]
    split = ops.variadic_split(merged, ops.constant(np.int64(-1)),
                               ops.constant(np.array(rows, dtype=np.int64)))
    for i, old in enumerate(olds):
        old.output(0).replace(split.output(i))


def _fuse_siblings(model: ov.Model) -> int:
    """Merge the compressed matrix products that read one tensor and whose outputs only feed
    layout ops, directly or through a constant bias Add (attention's q, k and v; not the MLP's
    gate and up), in groups of one kind of weights; how many groups."""
    groups = 0
    for op in list(model.get_ordered_ops()):
        for out in op.outputs():
            products = [t.get_node() for t in out.get_target_inputs()
                        if t.get_node().get_type_name() == "MatMul" and t.get_index() == 0]
            if len(products) < 2:
                continue
            by_key: dict[tuple[Any, ...], list[_Sibling]] = {}
            for p in products:
                s = _sibling(p)
                if s is not None:
                    by_key.setdefault(s.key(), []).append(s)
            for group in by_key.values():
                if len(group) >= 2:
                    _merge(out, group)
                    groups += 1
    return groups


def _drop_uniform_zeros(model: ov.Model) -> int:
    """u8 weights whose zero point is one value everywhere, and that minus it fits in 8 signed
    bits -> i8 without a zero point."""
    done = 0
    for op in list(model.get_ordered_ops()):
        if op.get_type_name() != "MatMul":
            continue
        w = compressed_weight(op)
        if w is None or w.weights.get_output_element_type(0) != ov.Type.u8:
            continue
        zeros = w.zero.get_data()
        if zeros.size == 0 or not bool((zeros == zeros.flat[0]).all()):
            continue
        # NOTE: in int16: uint8 minus a Python int stays uint8 in NumPy 2 and wraps around.
        signed16 = w.weights.get_data().astype(np.int16) - int(zeros.flat[0])
        if int(signed16.min()) < -128 or int(signed16.max()) > 127:
            continue
        signed = signed16.astype(np.int8)
        decompressed = ops.multiply(
            ops.convert(ops.constant(signed), w.to_float.get_output_element_type(0)), w.scale)
        w.multiply.output(0).replace(decompressed.output(0))
        done += 1
    return done


class Rewrites(NamedTuple):
    merged: int  # groups of projections merged into one product each
    signed: int  # 8-bit matrices made signed without a zero point


def optimize(model: ov.Model) -> Rewrites:
    """Apply the rewrites above to `model` in place; save it with
    `ov.save_model(model, path, compress_to_fp16=False)` to keep every constant's type."""
    groups = _fuse_siblings(model)
    signed = _drop_uniform_zeros(model)
    model.validate_nodes_and_infer_types()
    log.info("graph rewrites: %d groups of projections merged, %d 8-bit matrices signed",
             groups, signed)
    return Rewrites(groups, signed)
