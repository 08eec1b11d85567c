"""Each generated token's log-probability in the shape of each API (OpenAI chat and
completions, Ollama), from the worker's `TokenLogprob` entries; the prompt's tokens with theirs
(OpenAI completions' `echo`, vLLM's `prompt_logprobs`), the first one's null.

OpenVINO GenAI gives the sampled token's log-probability only, so a `top_logprobs` list holds
just the sampled token, whatever number was asked (up to the API's maximum): never an
invented alternative. A token's `token` is its piece of the text (the pieces concatenate to
the text; a character split across tokens belongs to the token that completes it, the others
have ""); `bytes` are the token's own bytes (a special token has none).
"""

from __future__ import annotations

import math
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


def _known(logprob: float) -> float | None:
    """A prompt's first token has no log-probability (NaN from the worker): null."""
    return None if math.isnan(logprob) else logprob


def openai_completion(entries: list[TokenLogprob], top: int, offset: int) -> dict[str, Any]:
    """A text completion's `logprobs`; `offset` is the characters of text before the first
    entry (text_offset counts from the start of the choice's text). With `echo`, the entries
    start with the prompt's, whose first has null for its logprob and its top_logprobs."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.text)
    logprobs = [_known(e.logprob) for e in entries]
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": logprobs,
        "top_logprobs": [None if lp is None else {e.text: lp}
                         for e, lp in zip(entries, logprobs, strict=True)] if top else None,
        "text_offset": offsets,
    }


def vllm_prompt(entries: list[TokenLogprob], ids: list[int]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}}
    (null for the first). The token itself only, its rank unknown (null)."""
    out: list[dict[str, Any] | None] = []
    for entry, token in zip(entries, ids, strict=True):
        logprob = _known(entry.logprob)
        out.append(None if logprob is None else {
            str(token): {"logprob": logprob, "rank": None, "decoded_token": entry.text}})
    return out


def ollama(entries: list[TokenLogprob], top: int) -> list[dict[str, Any]]:
    """Ollama's `logprobs`: [{token, logprob, bytes, top_logprobs}] (top_logprobs only when
    asked, as Ollama omits it)."""
    out = []
    for entry in entries:
        token = _token(entry)
        out.append({**token, "top_logprobs": [token]} if top else token)
    return out
