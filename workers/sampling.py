"""The internal SamplingParams -> openvino_genai.GenerationConfig, in one place."""

from __future__ import annotations

import openvino_genai as ov_genai

from npu_proxy.protocol.messages import SamplingParams

# NOTE: a request that names no limit still must end; Ollama's own default is unlimited
# (until the context is full), so the cap is the context left after the prompt.
DEFAULT_MAX_TOKENS = 2048


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
    limit = params.max_tokens if params.max_tokens is not None else DEFAULT_MAX_TOKENS
    cfg.max_new_tokens = max(1, min(limit, room))
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
        if params.seed is not None:
            cfg.rng_seed = params.seed
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
    if params.logprobs:
        # NOTE: OpenVINO GenAI gives the sampled token's log-probability only (any value > 1
        # is taken as 1), so no alternatives exist to return.
        cfg.logprobs = 1
    if params.json_schema is not None:
        cfg.structured_output_config = ov_genai.StructuredOutputConfig(
            json_schema=params.json_schema
        )
    elif params.regex is not None:
        cfg.structured_output_config = ov_genai.StructuredOutputConfig(regex=params.regex)
    return cfg
