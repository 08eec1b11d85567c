"""Anthropic Messages requests in the internal form: `system`, `messages` and their content
blocks, tools (gateway/api/anthropic.py serves the routes).

- `system` text blocks are joined (`cache_control` anywhere changes nothing); a `system` role
  inside `messages` (beta mid-conversation-tool-changes, as Claude Code sends) is appended to
  the system prompt, in order. Claude Code sends its environment (9 KB) that way, after the
  user's message; left there it was the last thing before the assistant's turn, and
  Qwen2.5-Coder-1.5B, continuing from it, repeated it for 2,124 tokens instead of working
  (bench/agents.py). The Messages API's system instructions are its top-level `system`; the
  text is the same in every request of a session, so the cached prefix still holds.
- Claude Code's billing line (`x-anthropic-billing-header: cc_version=...; cch=...;`, a text
  block or the first line of the system prompt, its `cch` new in every request) is metadata
  for Anthropic's servers, not for the model: left out and named in the ignored header.
  Kept, it made every request's prompt differ from the previous one within its first 20
  tokens, so each turn of Claude Code read its whole 12k-token prompt again instead of
  reusing the cached prefix (minutes a turn on a CPU).
- `document` blocks with a plain-text source (or text content blocks) are their text, after
  their title; PDFs and URLs are a 400 (the model cannot read them).
- A server tool's call and result in a history (`server_tool_use`, `web_search_tool_result`,
  ...) are text; thinking blocks are ignored.
- Tools: custom tools as given, Anthropic-defined client tools with their published schemas,
  server tools left out and named in the ignored header (gateway/content/tools/).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from npu_proxy.gateway.api.request_path import invalid, require
from npu_proxy.gateway.content.ignored import Ignored
from npu_proxy.gateway.content.images import Images
from npu_proxy.gateway.content.params import json_schema_text
from npu_proxy.gateway.content.tools import (
    ToolBudget,
    ToolRequest,
    anthropic_choice,
    anthropic_tools,
    history_call,
)
from npu_proxy.models.capabilities import VISION, Capabilities
from npu_proxy.protocol.messages import ChatMessage, joined_system

UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload")
IGNORED_BLOCKS = ("thinking", "redacted_thinking")


class InMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]]


def _block_text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}: a text block needs a string 'text'", param="messages")
    return text


BILLING = "x-anthropic-billing-header:"


def _without_billing(text: str, ignored: Ignored | None) -> str:
    """`text` without a leading billing line (the whole of it when it is that line)."""
    if not text.startswith(BILLING):
        return text
    if ignored is not None:
        ignored.add("system.x-anthropic-billing-header")
    return text.partition("\n")[2].lstrip("\n")


def system_text(system: str | list[dict[str, Any]] | None,
                ignored: Ignored | None = None) -> str:
    if system is None or isinstance(system, str):
        return _without_billing(system or "", ignored)
    parts = []
    for i, block in enumerate(system):
        if block.get("type") != "text":
            raise invalid(f"system[{i}]: only text blocks are supported", param="system")
        if text := _without_billing(_block_text(block, f"system[{i}]"), ignored):
            parts.append(text)
    return "\n\n".join(parts)


async def _image(block: dict[str, Any], where: str, caps: Capabilities, requested: str,
                 images: Images) -> bytes:
    """An image block's checked bytes: a base64 source (media_type image/*) or, where this
    server fetches URLs, a url source."""
    require(caps, VISION, requested, "messages")
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    field = f"{where}.source"
    if kind == "base64" and isinstance(source, dict):
        media = source.get("media_type")
        if not isinstance(media, str) or not media.lower().startswith("image/"):
            raise invalid(f"{field}.media_type must be an image type such as image/png",
                          param="messages")
        return await images.base64(source.get("data"), f"{field}.data", "messages")
    if kind == "url" and isinstance(source, dict):
        return await images.url(source.get("url"), f"{field}.url", "messages")
    raise invalid(f"{field}: an image source must be of type base64 or url", param="messages")


async def _result(block: dict[str, Any], where: str, caps: Capabilities, requested: str,
                  images: Images) -> tuple[str, list[bytes]]:
    """A tool result's text and images."""
    content = block.get("content")
    found: list[bytes] = []
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        parts = []
        for k, sub in enumerate(content):
            if sub.get("type") == "text":
                parts.append(_block_text(sub, where))
            elif sub.get("type") == "image":
                found.append(await _image(sub, f"{where}.content[{k}]", caps, requested,
                                          images))
            elif sub.get("type") == "document" and (doc := _document(sub)) is not None:
                parts.append(doc)
            elif sub.get("type") == "tool_reference" and isinstance(sub.get("tool_name"), str):
                # NOTE: the tool itself is offered from now on (loaded_tools); the model is
                # told so in the result, as its definition appears at the start of the prompt.
                parts.append(f"Tool {sub['tool_name']} loaded.")
            elif sub.get("type") in UNSUPPORTED_BLOCKS:
                raise invalid(f"{where}: {sub.get('type')} content is not supported by this "
                              "model", param="messages")
        text = "\n\n".join(parts)
    return (f"Error: {text}" if block.get("is_error") else text), found


def _document(block: dict[str, Any]) -> str | None:
    """A document block's text when its source is plain text (`{"type": "text", "data"}`) or
    text content blocks; None for a PDF or a URL, which this server cannot read."""
    source = block.get("source")
    if not isinstance(source, dict):
        return None
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        text = source["data"]
    elif source.get("type") == "content" and isinstance(source.get("content"), (str, list)):
        content = source["content"]
        text = content if isinstance(content, str) else "\n\n".join(
            b["text"] for b in content if isinstance(b, dict) and isinstance(b.get("text"), str))
    else:
        return None
    title = block.get("title")
    return f"{title}\n\n{text}" if isinstance(title, str) and title else text


def _server_block(block: dict[str, Any], kind: str) -> str:
    """A server tool's call (`server_tool_use`) or result (`*_tool_result`) in a history: the
    client replays what Anthropic's servers ran; the model reads it as text."""
    if kind == "server_tool_use":
        return f"[{block.get('name')} called with {json.dumps(block.get('input'))}]"
    return f"[{kind}: {json.dumps(block.get('content'), ensure_ascii=False)}]"


async def chat_messages(system: str | list[dict[str, Any]] | None, messages: list[InMessage],
                        caps: Capabilities, requested: str, images: Images,
                        ignored: Ignored | None = None) -> list[ChatMessage]:
    """The chat in the internal form; what the model cannot take (`caps`) is a 400. A user
    message's images go with its text (a tool result's with the tool message). A `system`
    message inside `messages` (Claude Code's mid-conversation system turns) is appended to the
    system prompt (the module's docstring says why)."""
    if not messages:
        raise invalid("messages: at least one message is required", param="messages")
    out: list[ChatMessage] = []
    systems = [system_text(system, ignored)]
    for i, m in enumerate(messages):
        if m.role not in ("user", "assistant", "system"):
            raise invalid(f"messages[{i}].role must be 'user', 'assistant' or 'system'",
                          param="messages")
        if m.role == "system":
            systems.append(system_text(m.content, ignored))
            if ignored is not None:
                ignored.move(f"messages[{i}] (role system) appended to the system prompt")
            continue
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) \
            else m.content
        texts: list[str] = []
        found: list[bytes] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            kind = block.get("type")
            if kind == "text":
                texts.append(_block_text(block, where))
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(block.get("name"), str):
                    raise invalid(f"{where}: tool_use needs a name", param="messages")
                calls.append(history_call(block.get("id"), block["name"], block.get("input")))
            elif kind == "tool_result" and m.role == "user":
                if texts or found:
                    out.append(ChatMessage(role="user", content="\n\n".join(texts),
                                           images=found))
                    texts, found = [], []
                text, result_images = await _result(block, where, caps, requested, images)
                out.append(ChatMessage(role="tool", content=text, images=result_images,
                                       tool_call_id=str(block.get("tool_use_id", ""))))
            elif kind == "image" and m.role == "user":
                found.append(await _image(block, where, caps, requested, images))
            elif kind == "document" and (doc := _document(block)) is not None:
                texts.append(doc)
            elif isinstance(kind, str) and (kind == "server_tool_use"
                                            or kind.endswith("_tool_result")):
                texts.append(_server_block(block, kind))
            elif kind in UNSUPPORTED_BLOCKS:
                if kind == "image":
                    require(caps, VISION, requested, "messages")
                raise invalid(f"{where}: {kind} content is not supported by this model",
                              param="messages")
            elif kind in IGNORED_BLOCKS:
                continue
            else:
                raise invalid(f"{where}: unknown content block type '{kind}'",
                              param="messages")
        if m.role == "assistant":
            out.append(ChatMessage(role="assistant", content="\n\n".join(texts),
                                   tool_calls=calls or None))
        elif texts or found or not blocks:
            out.append(ChatMessage(role="user", content="\n\n".join(texts), images=found))
    if text := joined_system(systems):
        out.insert(0, ChatMessage(role="system", content=text))
    return out


def output_schema(config: dict[str, Any] | None) -> str | None:
    """Structured outputs: `output_config.format = {"type": "json_schema", "schema": {...}}`."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or \
            not isinstance(fmt.get("schema"), dict):
        raise invalid("output_config.format must be {\"type\": \"json_schema\", \"schema\": "
                      "{...}}", param="output_config")
    return json_schema_text(fmt["schema"])


def loaded_tools(messages: list[InMessage], tool_choice: dict[str, Any] | None
                 ) -> frozenset[str]:
    """The deferred tools (`defer_loading`) the model is shown: those named by a
    `tool_reference` block in a tool result (a tool search's answer), and a tool_choice's."""
    names = {(tool_choice or {}).get("name")}
    for message in messages:
        if isinstance(message.content, str):
            continue
        for block in message.content:
            inner = block.get("content") if block.get("type") == "tool_result" else None
            for sub in inner if isinstance(inner, list) else []:
                if isinstance(sub, dict) and sub.get("type") == "tool_reference":
                    names.add(sub.get("tool_name"))
    return frozenset(n for n in names if isinstance(n, str))


def tool_request(tools: list[dict[str, Any]] | None, tool_choice: dict[str, Any] | None,
                 budget: ToolBudget, ignored: Ignored | None = None,
                 loaded: frozenset[str] = frozenset()) -> ToolRequest | None:
    offered = anthropic_tools(tools, budget, ignored, loaded)
    if not offered:
        return None
    choice, parallel = anthropic_choice(tool_choice, True)
    return ToolRequest(offered, choice, parallel)
