"""Each generated token's log-probability in the shape of each API (OpenAI chat and
completions, Ollama), from the worker's `TokenLogprob` entries.

OpenVINO GenAI gives the sampled token's log-probability only, so a `top_logprobs` list holds
just the sampled token, whatever number was asked (up to the API's maximum): never an
invented alternative. A token's `token` is its piece of the text (the pieces concatenate to
the text; a character split across tokens belongs to the token that completes it, the others
have ""); `bytes` are the token's own bytes (a special token has none).
"""

from __future__ import annotations

from typing import Any

from npu_proxy.gateway.core.errors import invalid
from npu_proxy.protocol.messages import TokenLogprob

# OpenAI's and Ollama's bound on top_logprobs; OpenAI completions' bound on logprobs.
MAX_TOP = 20
MAX_COMPLETION_TOP = 5


def top_count(value: int | None, param: str, limit: int = MAX_TOP) -> int:
    """The number of alternatives asked for, checked against the API's range."""
    if value is None:
        return 0
    if not 0 <= value <= limit:
        raise invalid(f"{param} must be between 0 and {limit}", param=param)
    return value


def _token(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": entry.text, "logprob": entry.logprob, "bytes": list(entry.data)}


def openai_chat(entries: list[TokenLogprob], top: int) -> dict[str, Any]:
    """A chat choice's `logprobs`: {"content": [...], "refusal": null}."""
    content = []
    for entry in entries:
        token = _token(entry)
        content.append({**token, "top_logprobs": [token] if top else []})
    return {"content": content, "refusal": None}


def openai_completion(entries: list[TokenLogprob], top: int, offset: int) -> dict[str, Any]:
    """A text completion's `logprobs`; `offset` is the characters of text before the first
    entry (text_offset counts from the start of the choice's text)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.text)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{e.text: e.logprob} for e in entries] if top else None,
        "text_offset": offsets,
    }


def ollama(entries: list[TokenLogprob], top: int) -> list[dict[str, Any]]:
    """Ollama's `logprobs`: [{token, logprob, bytes, top_logprobs}] (top_logprobs only when
    asked, as Ollama omits it)."""
    out = []
    for entry in entries:
        token = _token(entry)
        out.append({**token, "top_logprobs": [token]} if top else token)
    return out
