"""What a request gets from the model: its GenerationConfig (from the internal
SamplingParams, in one place) and its share of the context: the room left for the reply,
and which messages a truncated history keeps (Generate.truncate)."""

from __future__ import annotations

import secrets
from collections.abc import Callable

import msgspec
import openvino_genai as ov_genai

from npu_proxy.protocol.messages import ChatMessage, Generate, SamplingParams
from npu_proxy.workers.generation.structured import structured_output

# NOTE: a request that names no limit still must end: at this many tokens, or at the end
# of the context when it comes first. Asking for more (Ollama's num_predict -1, any
# max_tokens) runs to the end of the context at most.
DEFAULT_MAX_TOKENS = 2048
# A truncated history leaves the reply the tokens it asked for, at most this share of the
# context (a max_tokens of 32,000 must not drop the whole history).
REPLY_SHARE = 4


def wanted_tokens(max_tokens: int | None) -> int:
    """The most tokens a request may generate before the context's room clamps it: what it
    asked, or DEFAULT_MAX_TOKENS when it named no limit."""
    return DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens


def reply_reserve(max_tokens: int | None, context: int) -> int:
    """The room a truncated history keeps for the reply."""
    return max(1, min(wanted_tokens(max_tokens), context // REPLY_SHARE))


def droppable(messages: list[ChatMessage]) -> list[int]:
    """The indices of the messages truncation may drop, oldest first: none of the system
    messages, nor the last user message and what follows it (the turn being answered)."""
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    end = users[-1] if users else len(messages) - 1
    return [i for i in range(end) if messages[i].role not in ("system", "developer")]


def fewest_dropped(fits: Callable[[int], bool], most: int) -> int | None:
    """The fewest of `most` droppable messages to drop (oldest first) so that `fits`, or
    None when even dropping them all does not. Binary search: dropping more never makes a
    prompt longer, and each probe tokenizes the whole rest of the history."""
    if not fits(most):
        return None
    low, high = 0, most  # fits(high) holds; fits(low - 1) does not (or low is 0)
    while low < high:
        mid = (low + high) // 2
        if fits(mid):
            high = mid
        else:
            low = mid + 1
    return low


def trim_history(req: Generate, count: Callable[[Generate], int | None],
                 most: int) -> tuple[Generate, int]:
    """The request with its fewest oldest messages dropped so that its prompt has at most
    `most` tokens (`count`: the exact count, None when over the worker's limit), and how many
    went; all that `droppable` allows when even that is not enough (the caller checks)."""
    order = droppable(req.messages or [])

    def trimmed(k: int) -> Generate:
        gone = set(order[:k])
        kept = [m for i, m in enumerate(req.messages or []) if i not in gone]
        return msgspec.structs.replace(req, messages=kept)

    def fits(k: int) -> bool:
        n = count(trimmed(k))
        return n is not None and n <= most

    k = fewest_dropped(fits, len(order)) if order else 0
    k = len(order) if k is None else k
    return (trimmed(k), k) if k else (req, 0)


def generation_config(
    params: SamplingParams, base: ov_genai.GenerationConfig, room: int
) -> ov_genai.GenerationConfig:
    """Build a fresh GenerationConfig from the model's defaults and the request's params.

    `room` is how many tokens the context has left after the prompt.
    """
    cfg = ov_genai.GenerationConfig()
    if base.is_prompt_lookup():
        # NOTE: a prompt-lookup pipeline refuses any request without both fields.
        cfg.num_assistant_tokens = base.num_assistant_tokens
        cfg.max_ngram_size = base.max_ngram_size
    elif base.is_assisting_generation():
        if params.temperature is None or params.temperature > 0.0:
            # NOTE: OpenVINO GenAI 2026.4 fails a whole step, and so every request of the
            # worker, on sampled requests with a draft model ("Check 'content_length <=
            # prompt_ids.size() + m_generated_ids.size()' failed"), and add_request() refuses
            # a request without a draft setting on such a pipeline.
            raise ValueError("this model's worker decodes speculatively with a draft model "
                             "(draft_model), which serves greedy requests only: send "
                             "temperature 0")
        if base.assistant_confidence_threshold > 0:
            cfg.assistant_confidence_threshold = base.assistant_confidence_threshold
        else:
            cfg.num_assistant_tokens = base.num_assistant_tokens
    cfg.eos_token_id = base.eos_token_id
    cfg.stop_token_ids = set(base.stop_token_ids) | {base.eos_token_id}
    cfg.max_new_tokens = max(1, min(wanted_tokens(params.max_tokens), room))
    temperature = 1.0 if params.temperature is None else params.temperature
    if temperature <= 0.0:
        cfg.do_sample = False
    else:
        cfg.do_sample = True
        cfg.temperature = temperature
        cfg.top_p = 1.0 if params.top_p is None else params.top_p
        if params.top_k is not None and params.top_k > 0:
            cfg.top_k = params.top_k
        if params.min_p is not None:
            cfg.min_p = params.min_p
        # NOTE: GenAI's rng_seed defaults to 0, so every sampled request without a seed drew
        # the same numbers and a client's "regenerate" got the same text back; without a seed
        # a request gets a fresh one, as with OpenAI, Ollama and vLLM.
        cfg.rng_seed = params.seed if params.seed is not None else secrets.randbits(32)
    if params.repetition_penalty is not None:
        cfg.repetition_penalty = params.repetition_penalty
    if params.presence_penalty is not None:
        cfg.presence_penalty = params.presence_penalty
    if params.frequency_penalty is not None:
        cfg.frequency_penalty = params.frequency_penalty
    if params.stop:
        cfg.stop_strings = set(params.stop)
        cfg.include_stop_str_in_output = params.include_stop
    if params.ignore_eos:
        cfg.ignore_eos = True
        cfg.stop_token_ids = set()
    if params.logprobs or params.prompt_logprobs:
        # NOTE: OpenVINO GenAI gives the sampled token's log-probability only (any value > 1
        # is taken as 1), so no alternatives exist to return.
        cfg.logprobs = 1
    if params.prompt_logprobs:
        # NOTE: echo makes the pipeline return the prompt's ids, each with its log-probability
        # given the ones before it (the first one's is a placeholder), ahead of the generated
        # ones, in pieces as the prompt is read (measured: complete and the same numbers again
        # with the prompt in the prefix cache); it may generate nothing (GenAI takes
        # max_new_tokens 0 with echo only).
        cfg.echo = True
        if params.max_tokens == 0:
            cfg.max_new_tokens = 0
    if (constraint := structured_output(params)) is not None:
        cfg.structured_output_config = constraint
    return cfg
