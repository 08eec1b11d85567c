"""Whisper's encoder and stateful decoder as OpenVINO graphs, written with OpenVINO's graph API
from Transformers-named weights (models/whisper_ct2.py `state_dict`): no torch.

The two models are what optimum-intel's export writes and openvino-genai's WhisperPipeline
reads (src/cpp/src/whisper/models/statefull_decoder.cpp, word_level_timestamps.cpp):
- encoder: `input_features` [batch, mels, 3000] -> `last_hidden_state` [batch, 1500, width];
- decoder: `input_ids` [batch, tokens] (i64), `encoder_hidden_states` [batch, frames, width],
  `beam_idx` [batch] (i32) -> `logits` [batch, tokens, vocab]. The self-attention keys and
  values live in variables (ReadValue/Assign) whose rows `beam_idx` reorders; the
  cross-attention ones in variables initialised from `encoder_hidden_states`, so they are
  computed once per window, on the first step after the pipeline resets the state;
- the cross-attention ScaledDotProductAttention nodes' names hold `encoder_attn`: the ones
  GenAI decomposes to read their scores when asked for word timestamps.

Whisper (Radford et al.; Transformers' modeling_whisper.py): two convolutions with GELU,
sinusoidal positions; pre-norm layers (LayerNorm eps 1e-5) of attention and a GELU
feed-forward block; the decoder's logits are its token embeddings applied backwards.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino.op.util import Variable, VariableInfo

Weights = dict[str, np.ndarray[Any, Any]]
_EPS = 1e-5


def _named(node: Any, name: str) -> Any:
    node.get_output_tensor(0).set_names({name})
    return node


class _Builder:
    """The layers shared by the encoder and the decoder, over one set of weights."""

    def __init__(self, weights: Weights, heads: int) -> None:
        self.weights = weights
        self.heads = heads
        self.width = int(weights["model.decoder.embed_tokens.weight"].shape[1])
        self.head_dim = self.width // heads
        self._consts: dict[str, Any] = {}

    def const(self, name: str) -> Any:
        # NOTE: one Constant per weight: the token embeddings feed both the lookup and the
        # logits, and a second copy would double them in the .bin.
        if name not in self._consts:
            self._consts[name] = ops.constant(self.weights[name], name=name)
        return self._consts[name]

    def linear(self, x: Any, name: str) -> Any:
        y = ops.matmul(x, self.const(f"{name}.weight"), False, True)
        bias = f"{name}.bias"
        return ops.add(y, self.const(bias)) if bias in self.weights else y

    def norm(self, x: Any, name: str) -> Any:
        y = ops.mvn(x, ops.constant(np.array([-1], np.int64)), True, _EPS, "inside_sqrt")
        return ops.add(ops.multiply(y, self.const(f"{name}.weight")),
                       self.const(f"{name}.bias"))

    def split_heads(self, x: Any) -> Any:
        """[batch, n, width] -> [batch, heads, n, head_dim]."""
        shape = ops.constant(np.array([0, -1, self.heads, self.head_dim], np.int64))
        return ops.transpose(ops.reshape(x, shape, True), ops.constant(np.array([0, 2, 1, 3])))

    def merge_heads(self, x: Any) -> Any:
        merged = ops.transpose(x, ops.constant(np.array([0, 2, 1, 3])))
        return ops.reshape(merged, ops.constant(np.array([0, -1, self.width], np.int64)), True)

    def ffn(self, x: Any, layer: str) -> Any:
        h = self.norm(x, f"{layer}.final_layer_norm")
        h = ops.gelu(self.linear(h, f"{layer}.fc1"), "erf")
        return ops.add(x, self.linear(h, f"{layer}.fc2"))

    def query(self, x: Any, attn: str) -> Any:
        """The query projection with attention's 1/sqrt(head_dim) folded into its weights, as
        Transformers' Whisper scales it. NOTE: with the scale left to ScaledDotProductAttention
        the CPU plugin scaled and transposed the 1500 cross-attention keys at every decoding
        step (measured: a step took 1.8x as long); the scale is a power of two, so exact."""
        scale = np.float32(1.0 / np.sqrt(self.head_dim))
        weight = ops.constant(self.weights[f"{attn}.q_proj.weight"] * scale)
        bias = ops.constant(self.weights[f"{attn}.q_proj.bias"] * scale)
        return self.split_heads(ops.add(ops.matmul(x, weight, False, True), bias))

    def projections(self, x: Any, attn: str) -> tuple[Any, Any, Any]:
        return (self.query(x, attn), self.split_heads(self.linear(x, f"{attn}.k_proj")),
                self.split_heads(self.linear(x, f"{attn}.v_proj")))

    def attend(self, q: Any, k: Any, v: Any, attn: str, mask: Any = None) -> Any:
        # NOTE: scale 1: the queries come scaled (`query`). The cross-attention gets a mask
        # that masks nothing: GenAI's word timestamps read the scores where the decomposed
        # attention adds its mask (an Add), so there must be one.
        scale = ops.constant(np.float32(1.0))
        out = ops.scaled_dot_product_attention(
            q, k, v, ops.constant(np.float32(0.0)) if mask is None else mask, scale,
            name=f"{attn}/sdpa")
        return self.linear(self.merge_heads(out), f"{attn}.out_proj")


def _layers(weights: Weights, side: str) -> int:
    return len({name.split(".")[3] for name in weights if name.startswith(f"model.{side}.layers.")})


def encoder(weights: Weights, heads: int) -> ov.Model:
    b = _Builder(weights, heads)
    mels = int(weights["model.encoder.conv1.weight"].shape[1])
    features = ops.parameter([-1, mels, 3000], np.float32, name="input_features")
    _named(features, "input_features")
    x = features
    for conv, stride in (("conv1", 1), ("conv2", 2)):
        x = ops.convolution(x, b.const(f"model.encoder.{conv}.weight"), [stride], [1], [1], [1])
        bias = weights[f"model.encoder.{conv}.bias"].reshape(1, -1, 1)
        x = ops.gelu(ops.add(x, ops.constant(bias)), "erf")
    x = ops.transpose(x, ops.constant(np.array([0, 2, 1])))
    x = ops.add(x, b.const("model.encoder.embed_positions.weight"))
    for i in range(_layers(weights, "encoder")):
        layer = f"model.encoder.layers.{i}"
        h = b.norm(x, f"{layer}.self_attn_layer_norm")
        q, k, v = b.projections(h, f"{layer}.self_attn")
        x = ops.add(x, b.attend(q, k, v, f"{layer}.self_attn"))
        x = b.ffn(x, layer)
    out = _named(b.norm(x, "model.encoder.layer_norm"), "last_hidden_state")
    return ov.Model([ops.result(out)], [features], "whisper_encoder")


def _variable(name: str, heads: int, head_dim: int) -> Variable:
    """A cache variable: [batch, heads, tokens or frames, head_dim]."""
    info = VariableInfo()
    info.variable_id = name
    info.data_type = ov.Type.f32
    info.data_shape = ov.PartialShape([-1, heads, -1, head_dim])
    return Variable(info)


def decoder(weights: Weights, heads: int) -> ov.Model:
    b = _Builder(weights, heads)
    ids = _named(ops.parameter([-1, -1], np.int64, name="input_ids"), "input_ids")
    states = _named(ops.parameter([-1, -1, b.width], np.float32, name="encoder_hidden_states"),
                    "encoder_hidden_states")
    beam_idx = _named(ops.parameter([-1], np.int32, name="beam_idx"), "beam_idx")
    zero = ops.constant(np.array([0], np.int64))
    one = ops.constant(np.array([1], np.int64))
    ids_shape = ops.shape_of(ids, "i64")
    batch = ops.gather(ids_shape, zero, 0)
    tokens = ops.gather(ids_shape, one, 0)
    # NOTE: an empty [batch, heads, 0, head_dim] cache is what the self-attention variables
    # start from after each reset; its 0 is the sequence axis get_kv_axes_pos looks for.
    empty = ops.broadcast(ops.constant(np.float32(0)), ops.concat(
        [batch, ops.constant(np.array([heads, 0, b.head_dim], np.int64))], 0))
    sinks: list[Any] = []
    layers = _layers(weights, "decoder")
    past: list[tuple[Any, Any]] = []
    for i in range(layers):
        pair = []
        for kind in ("key", "value"):
            variable = _variable(f"past_key_values.{i}.decoder.{kind}", heads, b.head_dim)
            pair.append((variable, ops.gather(ops.read_value(empty, variable), beam_idx, 0)))
        past.append((pair[0], pair[1]))
    past_len = ops.gather(ops.shape_of(past[0][0][1], "i64"), ops.constant(np.array([2])), 0)
    total = ops.add(past_len, tokens)
    scalar = ops.constant(np.array([], np.int64))
    positions = ops.range(ops.reshape(past_len, scalar, False), ops.reshape(total, scalar, False),
                          ops.constant(np.int64(1)), "i64")
    keys = ops.range(ops.constant(np.int64(0)), ops.reshape(total, scalar, False),
                     ops.constant(np.int64(1)), "i64")
    # NOTE: query t (at position past_len + t) sees keys 0..past_len + t: the causal mask of
    # a decoder that is fed one token, or the whole prompt, per step.
    mask = ops.less_equal(ops.unsqueeze(keys, 0), ops.unsqueeze(positions, 1))
    x = ops.add(ops.gather(b.const("model.decoder.embed_tokens.weight"), ids, 0),
                ops.gather(b.const("model.decoder.embed_positions.weight"), positions, 0))
    for i in range(layers):
        layer = f"model.decoder.layers.{i}"
        h = b.norm(x, f"{layer}.self_attn_layer_norm")
        q, k, v = b.projections(h, f"{layer}.self_attn")
        full = []
        for (variable, cached), new in zip(past[i], (k, v), strict=True):
            joined = ops.concat([cached, new], 2)
            sinks.append(ops.assign(joined, variable))
            full.append(joined)
        x = ops.add(x, b.attend(q, full[0], full[1], f"{layer}.self_attn", mask))
        h = b.norm(x, f"{layer}.encoder_attn_layer_norm")
        q = b.query(h, f"{layer}.encoder_attn")
        cross = []
        for kind, proj in (("key", "k_proj"), ("value", "v_proj")):
            init = b.split_heads(b.linear(states, f"{layer}.encoder_attn.{proj}"))
            variable = _variable(f"past_key_values.{i}.encoder.{kind}", heads, b.head_dim)
            read = ops.read_value(init, variable)
            sinks.append(ops.assign(read, variable))
            cross.append(read)
        x = ops.add(x, b.attend(q, cross[0], cross[1], f"{layer}.encoder_attn"))
        x = b.ffn(x, layer)
    x = b.norm(x, "model.decoder.layer_norm")
    logits = ops.matmul(x, b.const("model.decoder.embed_tokens.weight"), False, True)
    model = ov.Model([ops.result(_named(logits, "logits"))], sinks, [ids, states, beam_idx],
                     "whisper_decoder")
    return model

