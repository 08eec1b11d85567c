"""What OpenAI's chat and text completions share: the sampling fields, their parameters,
usage and finish reasons, the reply's envelope."""

from __future__ import annotations

from typing import Any

import msgspec

from npu_proxy.gateway.api.request_path import Generation, invalid, new_id, now
from npu_proxy.gateway.content.params import openai_params
from npu_proxy.protocol.messages import SamplingParams

FINISH = {"stop": "stop", "length": "length", "abort": "stop", "timeout": "length"}


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct):
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Extensions some clients send (vLLM style).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False


def check_common(req: SamplingFields) -> None:
    if req.n not in (None, 1):
        raise invalid("only n=1 is supported", param="n")


def sampling_params(req: SamplingFields, max_tokens: int | None,
                    schema: str | None) -> SamplingParams:
    return openai_params(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, stop=req.stop,
        seed=req.seed, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, json_schema=schema,
        ignore_eos=req.ignore_eos)


def usage_json(gen: Generation) -> dict[str, int]:
    fin = gen.finished
    prompt = fin.prompt_tokens if fin else gen.accepted.prompt_tokens
    completion = fin.completion_tokens if fin else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def finish_reason(gen: Generation, calls: bool = False, named: bool = False) -> str:
    if calls and not gen.cut:
        # NOTE: OpenAI answers a named tool_choice with "stop", "required"/"auto" with
        # "tool_calls"; a call cut off by max_tokens with "length", as here.
        return "stop" if named else "tool_calls"
    return FINISH.get(gen.finished.finish_reason if gen.finished else "stop", "stop")


def wants_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


class Reply:
    """What chat and text completions share: the id, the envelope of a body or chunk, usage."""

    def __init__(self, prefix: str, model: str, include_usage: bool) -> None:
        self.id = new_id(prefix)
        self.model = model
        self.include_usage = include_usage

    def envelope(self, kind: str, created: int, choices: list[Any]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def chunk(self, kind: str, created: int, choice: dict[str, Any]) -> dict[str, Any]:
        obj = self.envelope(kind, created, [choice])
        if self.include_usage:
            obj["usage"] = None
        return obj

    def whole(self, kind: str, gen: Generation, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self.envelope(kind, now(), [choice]), "usage": usage_json(gen)}
