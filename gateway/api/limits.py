"""The limits every request is held to, answered before anything reaches a worker.

All are settings of protocol/config/, and each refusal is in the caller's API's own error
shape and status (`dialect_for(scope)`, gateway/http/wire.py):

- the body's size (`max_body_bytes`): gateway/http/body_limit.py;
- what one generation asks for: messages (`max_messages`), tools (`max_tools`) and characters
  of prompt text (`max_prompt_chars`): `Limits`, asked by the one request path
  (gateway/api/request_path.py) for every chat, generate and token count, so no dialect checks
  them itself. Each is a 400 naming the limit and its setting.

Output asked beyond the context (max_tokens 32,000 from Qwen Code and Claude Code) is no limit
here: the worker clamps it to the room the prompt leaves and ends with the length reason, as
Ollama and llama.cpp's server do (workers/generation/sampling.py). A prompt that does not
fit the context is the worker's to find (it counts exactly); gateway/core/errors.py
`ContextOverflow`.

Embeddings keep their own two (`max_embed_items`, `max_embed_chars`) in
gateway/api/embeddings.py, since their inputs are not a conversation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from npu_proxy.gateway.content.json_size import ToolBudget
from npu_proxy.gateway.core.errors import ContextOverflow, GatewayError, invalid
from npu_proxy.protocol.config import Config
from npu_proxy.protocol.messages import ChatMessage

if TYPE_CHECKING:
    from npu_proxy.gateway.content.tools import ToolRequest
    from npu_proxy.gateway.core.catalog import ModelCatalog
    from npu_proxy.gateway.core.model_table import ServedModel

# NOTE: no vocabulary comes near it; bounds ids before they cross to the worker as int64.
MAX_TOKEN_ID = 2**31 - 1
# Token ids one request takes when the model's context length is unknown.
DETOKENIZE_IDS = 131_072


# --- a generation ------------------------------------------------------------------------


def prompt_chars(messages: list[ChatMessage] | None, prompt: str | None,
                 tools: ToolRequest | None = None) -> int:
    """Characters of text the tokenizer would get from the client: every message's content
    (the system prompt is one), the raw prompt and the definitions of the tools offered (as
    measured before their text is made: Tool.chars); the arguments of earlier calls are
    bounded by `max_body_bytes` instead."""
    offered = sum(t.chars for t in tools.offered) if tools is not None else 0
    return sum(len(m.content) for m in messages or ()) + len(prompt or "") + offered


class Limits:
    """The checks of one generation or token count, before it is prepared and dispatched."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def tool_budget(self) -> ToolBudget:
        """What the tools of one request may add to its prompt, charged as they are measured
        (`max_prompt_chars`): their measuring stops at the limit, whatever the body holds."""
        return ToolBudget(self.config.max_prompt_chars)

    def check_items(self, items: int, tools: int) -> None:
        """The Responses API's input items and tools, counted as sent, before they are
        translated (several items may make one message, some none): the same two limits."""
        if items > self.config.max_messages:
            raise invalid(f"the request has {items} input items; the limit is "
                          f"{self.config.max_messages} (max_messages)", param="input")
        if tools > self.config.max_tools:
            raise invalid(f"the request offers {tools} tools; the limit is "
                          f"{self.config.max_tools} (max_tools)", param="tools")

    def check_counts(self, messages: int, tools: int) -> None:
        """The counts as decoded, before any per-message work (a million empty messages
        translated one by one held the event loop for seconds before the count refused
        them)."""
        limit = self.config.max_messages
        if messages > limit:
            raise invalid(f"the request has {messages} messages; the limit is {limit} "
                          "(max_messages)", param="messages")
        limit = self.config.max_tools
        if tools > limit:
            raise invalid(f"the request offers {tools} tools; the limit is {limit} "
                          "(max_tools)", param="tools")

    def check_input(self, messages: list[ChatMessage] | None, prompt: str | None,
                    tools: ToolRequest | None) -> None:
        """Counts and prompt length: a 400 naming the limit and its setting."""
        self.check_counts(len(messages or ()), len(tools.tools) if tools is not None else 0)
        limit = self.config.max_prompt_chars
        chars = prompt_chars(messages, prompt, tools)
        if chars > limit:
            # NOTE: "prompt is too long" is how Anthropic words it (Claude Code offers to
            # compact on it), and OpenAI clients trim history on context_length_exceeded.
            raise GatewayError(400, "context_length_exceeded",
                               f"prompt is too long: {chars} characters; the limit is {limit} "
                               "characters (max_prompt_chars)",
                               param="prompt" if prompt is not None else "messages")


async def check_token_ids(catalog: ModelCatalog, model: ServedModel, ids: list[int],
                          param: str) -> None:
    """Token ids from a client, before a worker sees them: no more than the model's context
    holds (DETOKENIZE_IDS when unknown), each a plausible id (the worker checks them against
    its vocabulary). Counted first: 2 M ids took the worker 0.9 s and made a reply above the
    frame limit, which drops the gateway's link to the worker with others' frames in it.
    A prompt's (`param` "prompt") too many is the API's context-length error."""
    context = await catalog.context_length(model)
    limit = context or DETOKENIZE_IDS
    if len(ids) > limit and param == "prompt":
        raise ContextOverflow(f"the prompt is {len(ids)} tokens, more than the context of "
                              f"model '{model.name}' ({limit} tokens)", len(ids), len(ids),
                              limit - 1, limit, param=param)
    if len(ids) > limit:
        raise invalid(f"the request has {len(ids)} token ids; the limit is {limit}"
                      + (f", the context length of model '{model.name}'" if context else ""),
                      param=param)
    bad = next((t for t in ids if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise invalid(f"token id {bad} is not in the vocabulary", param=param)
