"""One mapping from each API's sampling fields to the internal SamplingParams.

OpenAI, Ollama and Anthropic requests all land here, so the same request expressed through
any API produces the same generation.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import msgspec

from npu_proxy.gateway.content.stops import stop_list
from npu_proxy.gateway.core.errors import invalid
from npu_proxy.protocol.messages import SamplingParams

log = logging.getLogger(__name__)

# Ollama's own sampling defaults (its DefaultOptions), for a request to its API where neither
# the request nor the model sets one: an Ollama client that sends no options samples as it
# would against Ollama (OpenAI's defaults are GenAI's: temperature 1, no top-k, top-p 1).
# NOTE: not its repeat_penalty 1.1 over the last 64 tokens: GenAI's penalty counts every
# earlier token, which is another penalty, so none is applied unless asked for.
OLLAMA_DEFAULTS = SamplingParams(temperature=0.8, top_k=40, top_p=0.9)

# Ollama options that exist but have no OpenVINO GenAI counterpart: accepted and ignored.
OLLAMA_IGNORED = frozenset({
    "mirostat", "mirostat_eta", "mirostat_tau", "tfs_z", "typical_p", "repeat_last_n",
    "num_keep", "num_thread", "num_gpu", "main_gpu", "numa", "low_vram", "f16_kv",
    "vocab_only", "use_mmap", "use_mlock", "num_batch", "penalize_newline", "logits_all",
    "embedding_only", "rope_frequency_base", "rope_frequency_scale", "num_gqa",
})


# NOTE: integers cross to the worker as MessagePack int64; JSON allows any size.
_INT64 = 2**63


def _int64(name: str, value: int | None, param: str | None = None) -> None:
    if value is not None and not -_INT64 <= value < _INT64:
        raise invalid(f"{name} is out of range: {value} is not a 64-bit integer",
                      param=param or name)


def _check_ranges(params: SamplingParams, param: str | None = None) -> SamplingParams:
    """The sampling numbers in the ranges OpenVINO takes (GenerationConfig.validate's), or a
    400 naming the field; `param` is set for Ollama, whose fields are all `options`.

    NOTE: JSON's 1e999 decodes to inf and Ollama's lax options turn "nan" into NaN, which
    every `a <= x <= b` check lets through the wrong way round: isfinite comes first.
    """
    ranges: tuple[tuple[str, float | None, float, float], ...] = (
        ("temperature", params.temperature, 0.0, 100.0),
        ("top_p", params.top_p, 0.0, 1.0),
        ("min_p", params.min_p, 0.0, 1.0),
        ("repeat_penalty" if param else "repetition_penalty", params.repetition_penalty,
         0.0, 100.0),
        ("presence_penalty", params.presence_penalty, -2.0, 2.0),
        ("frequency_penalty", params.frequency_penalty, -2.0, 2.0),
    )
    for name, value, low, high in ranges:
        if value is None:
            continue
        if not math.isfinite(value) or not low <= value <= high or (
                name.startswith("rep") and value == 0.0):
            raise invalid(f"{name} must be a number from {low:g} to {high:g}"
                          f"{' (not 0)' if name.startswith('rep') else ''}; got {value}",
                          param=param or name)
    return params


def json_schema_text(schema: Any) -> str:
    """A JSON schema for structured output; `True`/`None` means any JSON object."""
    if schema is None or schema is True:
        return json.dumps({"type": "object"})
    if not isinstance(schema, dict):
        raise invalid("the JSON schema must be an object", param="format")
    return json.dumps(schema)


def openai_params(
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    stop: str | list[str] | None,
    seed: int | None,
    presence_penalty: float | None,
    frequency_penalty: float | None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    json_schema: str | None = None,
    ignore_eos: bool = False,
    stop_param: str = "stop",
) -> SamplingParams:
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise invalid("temperature must be between 0 and 2", param="temperature")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise invalid("top_p must be in (0, 1]", param="top_p")
    if max_tokens is not None and max_tokens < 1:
        raise invalid("max_tokens must be at least 1", param="max_tokens")
    for name, number in (("max_tokens", max_tokens), ("seed", seed), ("top_k", top_k)):
        _int64(name, number)
    for name, value in (("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty)):
        if value is not None and not -2.0 <= value <= 2.0:
            raise invalid(f"{name} must be between -2 and 2", param=name)
    return _check_ranges(SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        seed=seed,
        stop=stop_list(stop, stop_param),
        json_schema=json_schema,
        ignore_eos=ignore_eos,
    ))


def anthropic_params(
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    stop_sequences: list[str] | None,
) -> SamplingParams:
    """Anthropic Messages: max_tokens is required and temperature is in [0, 1]. A matched stop
    sequence stays in the worker's text (`include_stop`) so the response can name it."""
    if max_tokens is None:
        raise invalid("max_tokens: Field required", param="max_tokens")
    if temperature is not None and not 0.0 <= temperature <= 1.0:
        raise invalid("temperature: must be between 0 and 1", param="temperature")
    if top_k is not None and top_k < 0:
        raise invalid("top_k: must be at least 0", param="top_k")
    params = openai_params(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                           stop=stop_sequences, seed=None, presence_penalty=None,
                           frequency_penalty=None, top_k=top_k, stop_param="stop_sequences")
    return msgspec.structs.replace(params, include_stop=bool(params.stop))


# A max_tokens no context reaches: the worker stops at the end of the context instead.
UNTIL_CONTEXT_FULL = 2**31 - 1


class OllamaOptions(msgspec.Struct, omit_defaults=True):
    num_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    num_ctx: int | None = None


def ollama_params(options: dict[str, Any] | None, json_schema: str | None) -> SamplingParams:
    options = dict(options or {})
    for key in list(options):
        if key in OLLAMA_IGNORED:
            log.debug("ignoring unsupported Ollama option %s=%r", key, options.pop(key))
    try:
        # NOTE: lax conversion, since clients send integers as floats (1.0) and vice versa.
        opts = msgspec.convert(options, OllamaOptions, strict=False)
    except msgspec.ValidationError as exc:
        raise invalid(f"invalid option: {exc}", param="options") from exc
    for name in ("num_predict", "top_k", "seed", "num_ctx"):
        _int64(name, getattr(opts, name), param="options")
    max_tokens = opts.num_predict
    if max_tokens is not None and max_tokens < 0:
        # NOTE: -1 (and -2): until the context is full. The worker clamps any max_tokens to
        # the room the prompt leaves, so the largest number means exactly that.
        max_tokens = UNTIL_CONTEXT_FULL
    return _check_ranges(SamplingParams(
        max_tokens=max_tokens if max_tokens != 0 else 1,
        temperature=opts.temperature,
        top_p=opts.top_p,
        top_k=opts.top_k,
        min_p=opts.min_p,
        repetition_penalty=opts.repeat_penalty,
        presence_penalty=opts.presence_penalty,
        frequency_penalty=opts.frequency_penalty,
        seed=opts.seed,
        stop=stop_list(opts.stop, "options.stop"),
        json_schema=json_schema,
        num_ctx=opts.num_ctx,
    ), param="options")
