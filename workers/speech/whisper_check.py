"""A built Whisper IR checked against a numpy forward pass of the same weights before it is
used: a graph that computes something else (a transposed weight, a wrong mask or cache) is
refused, not published.

The sample is fixed pseudo-random log-mel features (what the encoder sees is in [-1, 1.5]):
the encoder's output and the decoder's logits for the first step (three prompt tokens) and a
second step through the key/value cache are compared with f32 inference, where the two agree
to about 1e-6 of the values' range (measured on tiny.en); `TOLERANCE` leaves room for other
CPUs' kernels and still refuses any real error, which moves them by tens of percent.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

log = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]
# Largest difference allowed, as a fraction of the reference's largest absolute value.
TOLERANCE = 1e-3
_PROMPT = (50257, 50362, 440)  # <|startoftranscript|> <|notimestamps|> " The"
_NEXT = 1002


class WhisperCheckError(RuntimeError):
    """The built IR disagrees with numpy: it must not be used."""


def _erf(x: Array) -> Array:
    # NOTE: numpy has no erf; Abramowitz & Stegun 7.1.26, error below 1.5e-7.
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (
        -1.453152027 + t * 1.061405429))))
    out: Array = np.sign(x) * (1.0 - poly * np.exp(-x * x))
    return out


def _gelu(x: Array) -> Array:
    out: Array = 0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)))
    return out


class _Reference:
    def __init__(self, weights: dict[str, Array], heads: int) -> None:
        self.w = weights
        self.heads = heads

    def linear(self, x: Array, name: str) -> Array:
        y: Array = x @ self.w[f"{name}.weight"].T
        bias = self.w.get(f"{name}.bias")
        return y if bias is None else y + bias

    def norm(self, x: Array, name: str) -> Array:
        mean = x.mean(-1, keepdims=True)
        var = x.var(-1, keepdims=True)
        out: Array = (x - mean) / np.sqrt(var + 1e-5) * self.w[f"{name}.weight"]
        return out + self.w[f"{name}.bias"]

    def attention(self, x: Array, source: Array, name: str, causal: bool) -> Array:
        def heads(y: Array) -> Array:
            return y.reshape(y.shape[0], self.heads, -1).transpose(1, 0, 2)

        q = heads(self.linear(x, f"{name}.q_proj"))
        k = heads(self.linear(source, f"{name}.k_proj"))
        v = heads(self.linear(source, f"{name}.v_proj"))
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
        if causal:
            scores = scores + np.triu(np.full(scores.shape[1:], -np.inf), 1)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        out = (scores / scores.sum(-1, keepdims=True)) @ v
        return self.linear(out.transpose(1, 0, 2).reshape(x.shape[0], -1), f"{name}.out_proj")

    def ffn(self, x: Array, layer: str) -> Array:
        h = _gelu(self.linear(self.norm(x, f"{layer}.final_layer_norm"), f"{layer}.fc1"))
        return x + self.linear(h, f"{layer}.fc2")

    def encoder(self, features: Array) -> Array:
        x = features
        for conv, stride in (("conv1", 1), ("conv2", 2)):
            weight = self.w[f"model.encoder.{conv}.weight"]
            padded = np.pad(x, ((0, 0), (1, 1)))
            frames = (padded.shape[1] - 3) // stride + 1
            cols = np.stack([padded[:, k:k + stride * frames:stride] for k in range(3)], 1)
            x = weight.reshape(weight.shape[0], -1) @ cols.reshape(-1, frames)
            x = _gelu(x + self.w[f"model.encoder.{conv}.bias"][:, None])
        x = x.T + self.w["model.encoder.embed_positions.weight"]
        for i in range(_count(self.w, "encoder")):
            layer = f"model.encoder.layers.{i}"
            h = self.norm(x, f"{layer}.self_attn_layer_norm")
            x = x + self.attention(h, h, f"{layer}.self_attn", causal=False)
            x = self.ffn(x, layer)
        return self.norm(x, "model.encoder.layer_norm")

    def logits(self, ids: list[int], states: Array) -> Array:
        x = self.w["model.decoder.embed_tokens.weight"][ids] + \
            self.w["model.decoder.embed_positions.weight"][:len(ids)]
        for i in range(_count(self.w, "decoder")):
            layer = f"model.decoder.layers.{i}"
            h = self.norm(x, f"{layer}.self_attn_layer_norm")
            x = x + self.attention(h, h, f"{layer}.self_attn", causal=True)
            h = self.norm(x, f"{layer}.encoder_attn_layer_norm")
            x = x + self.attention(h, states, f"{layer}.encoder_attn", causal=False)
            x = self.ffn(x, layer)
        x = self.norm(x, "model.decoder.layer_norm")
        out: Array = x @ self.w["model.decoder.embed_tokens.weight"].T
        return out


def _count(weights: dict[str, Array], side: str) -> int:
    return len({n.split(".")[3] for n in weights if n.startswith(f"model.{side}.layers.")})


def _compare(what: str, got: Array, want: Array) -> float:
    error = float(np.abs(got - want).max() / np.abs(want).max())
    if not error <= TOLERANCE:
        raise WhisperCheckError(
            f"the built Whisper IR's {what} differs from numpy's by {error:.2e} of its range "
            f"(allowed {TOLERANCE:.0e}): the conversion is wrong, so it is not used")
    return error


def check_ir(folder: Path, weights: dict[str, Array], heads: int) -> None:
    """Raise WhisperCheckError unless the IR in `folder` computes what numpy does."""
    core = ov.Core()
    exact = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
    mels = weights["model.encoder.conv1.weight"].shape[1]
    rng = np.random.default_rng(31)
    features = rng.uniform(-1.0, 1.5, (1, mels, 3000)).astype(np.float32)
    ref = _Reference(weights, heads)
    encoder = core.compile_model(folder / "openvino_encoder_model.xml", "CPU", exact)
    states = encoder(features)[0]
    want_states = ref.encoder(features[0])
    errors = [_compare("encoder output", states[0], want_states)]
    request = core.compile_model(folder / "openvino_decoder_model.xml", "CPU",
                                 exact).create_infer_request()
    steps: list[list[int]] = [list(_PROMPT), [_NEXT]]
    for i, ids in enumerate(steps):
        request.infer({"input_ids": np.array([ids], np.int64), "encoder_hidden_states": states,
                       "beam_idx": np.zeros(1, np.int32)})
        got = request.get_tensor("logits").data[0, -1]
        seen = [t for step in steps[:i + 1] for t in step]
        errors.append(_compare(f"logits at step {i + 1}", got,
                               ref.logits(seen, want_states)[-1]))
    log.info("the built Whisper IR agrees with numpy (largest differences: %s of the range)",
             ", ".join(f"{e:.1e}" for e in errors))
