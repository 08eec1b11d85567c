"""What a model made by /api/create adds to every request for it, in every API.

A created model (models/created.py) may carry a system prompt, messages that start every
conversation, and parameters. They apply the way Ollama applies a Modelfile's:
- the system prompt when the request brings none of its own (a request's first message
  with role system wins);
- the MESSAGE history before the request's messages (after the system prompt);
- each parameter where the request leaves that option unset (request options win).
The shared request path (gateway/api/request_path.py) calls `with_messages` and `with_params` for
every chat, generate and token count, so the OpenAI and Anthropic APIs see the same model
as Ollama's.
"""

from __future__ import annotations

from typing import Any

import msgspec

from npu_proxy.gateway.content.params import OLLAMA_IGNORED, OllamaOptions, ollama_params
from npu_proxy.gateway.core.errors import invalid
from npu_proxy.gateway.core.model_table import ServedModel
from npu_proxy.models.created import CreatedModel
from npu_proxy.protocol.messages import ChatMessage, SamplingParams

_KNOWN = frozenset(OllamaOptions.__struct_fields__) | OLLAMA_IGNORED


def check_parameters(parameters: dict[str, Any]) -> dict[str, Any]:
    """A created model's parameters, checked like request options (a 400 on a wrong type)
    and refused when unknown, so a typo never becomes a setting that silently does nothing.
    `stop` is kept as a list."""
    unknown = sorted(set(parameters) - _KNOWN)
    if unknown:
        raise invalid(f"unknown parameter {unknown[0]!r}; known are "
                      f"{', '.join(sorted(OllamaOptions.__struct_fields__))} and the options "
                      "Ollama accepts but this server ignores", param="parameters")
    ollama_params(parameters, None)
    checked = dict(parameters)
    if isinstance(checked.get("stop"), str):
        checked["stop"] = [checked["stop"]]
    return checked


# A created model's parameters as SamplingParams, parsed once per model (a model deleted and
# made again under its name has another `created_at`). Bounded: models are few, and a store
# that churns through more only parses again.
_PARSED: dict[tuple[str, float], SamplingParams] = {}
_PARSED_MAX = 256


def _defaults(model: ServedModel, record: CreatedModel) -> SamplingParams:
    key = (model.name, record.created_at)
    if (known := _PARSED.get(key)) is not None:
        return known
    if len(_PARSED) >= _PARSED_MAX:
        _PARSED.clear()
    known_params = {k: v for k, v in record.parameters.items() if k not in OLLAMA_IGNORED}
    _PARSED[key] = parsed = ollama_params(known_params, None)
    return parsed


def with_params(params: SamplingParams, model: ServedModel,
                *fallbacks: SamplingParams | None) -> SamplingParams:
    """`params` with every field the request left unset taken from the created model's
    parameters, then from each of `fallbacks` in turn (RequestPath.sampling: the model's own
    defaults, then the API's)."""
    if model.created is not None and model.created.parameters:
        params = _fill(params, _defaults(model, model.created))
    for fallback in fallbacks:
        if fallback is not None:
            params = _fill(params, fallback)
    return params


def _fill(params: SamplingParams, defaults: SamplingParams) -> SamplingParams:
    unset: dict[str, Any] = {}
    for field in SamplingParams.__struct_fields__:
        mine, theirs = getattr(params, field), getattr(defaults, field)
        if mine in (None, []) and theirs not in (None, []):
            unset[field] = theirs
    return msgspec.structs.replace(params, **unset) if unset else params


def with_messages(messages: list[ChatMessage], model: ServedModel) -> list[ChatMessage]:
    """The conversation as the model sees it: system prompt, its MESSAGE history, then the
    request's own messages."""
    record = model.created
    if record is None or (not record.system and not record.messages):
        return messages
    rest = list(messages)
    system = [rest.pop(0)] if rest and rest[0].role == "system" else []
    if not system and record.system:
        system = [ChatMessage(role="system", content=record.system)]
    history = [ChatMessage(role=m.role, content=m.content) for m in record.messages]
    return [*system, *history, *rest]
