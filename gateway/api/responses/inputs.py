"""The Responses API's `input` items as chat messages.

- `message` items: roles user, assistant, system and developer (= system: Codex sends its
  system prompt as developer messages); content a string or parts `input_text`/`output_text`
  (`refusal` as its text); `input_image` parts on a model with vision (gateway/content/images.py
  checks them), elsewhere the capability's 400; files and audio a 400.
- `function_call` / `custom_tool_call` (an assistant's call, consecutive ones make one
  assistant turn; a `namespace` is dropped, the model knows inner tools by their own names)
  and `function_call_output` / `custom_tool_call_output` (the tool's answer).
- `reasoning` items: their `encrypted_content` (gateway/api/responses/sealed.py) becomes the
  next assistant turn's reasoning; one this server cannot open, or one without it, is left out
  (named in the ignored header when it had a blob).
- Items of hosted tools (`web_search_call`, ..., their outputs) never came from this server:
  left out, named in the ignored header. Any other item type is a 400.
"""

from __future__ import annotations

from typing import Any

from npu_proxy.gateway.api.request_path import invalid, require
from npu_proxy.gateway.api.responses.sealed import Sealer
from npu_proxy.gateway.content.ignored import Ignored
from npu_proxy.gateway.content.images import Images
from npu_proxy.gateway.content.tools import CUSTOM_INPUT, history_call
from npu_proxy.models.capabilities import VISION, Capabilities
from npu_proxy.protocol.messages import ChatMessage

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
CALLS = ("function_call", "custom_tool_call")
OUTPUTS = ("function_call_output", "custom_tool_call_output")


async def _content(value: Any, where: str, caps: Capabilities, requested: str,
                   images: Images) -> tuple[str, list[bytes]]:
    """An item's text and images."""
    if isinstance(value, str):
        return value, []
    if not isinstance(value, list):
        raise invalid(f"{where}.content must be a string or a list of parts", param="input")
    texts = []
    found: list[bytes] = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind == "input_image":
            require(caps, VISION, requested, "input")
            if part.get("image_url") is None:
                raise invalid(f"{where}.content[{j}]: an input_image needs an image_url (a data "
                              "URL or an http(s) URL); file_id is not supported", param="input")
            found.append(await images.url(part["image_url"], f"{where}.content[{j}].image_url",
                                          "input"))
        elif kind in ("input_file", "input_audio"):
            raise invalid(f"{where}.content[{j}]: {kind} is not supported by this model",
                          param="input")
        else:
            raise invalid(f"{where}.content[{j}] must be a part of type input_text or "
                          "output_text with a string 'text'", param="input")
    return "".join(texts), found


def _call(item: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    name, call_id = item.get("name"), item.get("call_id")
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise invalid(f"{where}: a {kind} needs a string call_id and name", param="input")
    if kind == "custom_tool_call":
        text = item.get("input")
        return history_call(call_id, name, {CUSTOM_INPUT: text if isinstance(text, str) else ""})
    return history_call(call_id, name, item.get("arguments"))


class InputReader:
    """One request's input items; `ignored` collects what is left out."""

    def __init__(self, caps: Capabilities, requested: str, images: Images, sealer: Sealer,
                 ignored: Ignored) -> None:
        self.caps, self.requested, self.images = caps, requested, images
        self.sealer, self.ignored = sealer, ignored

    def _reasoning(self, item: dict[str, Any]) -> str | None:
        blob = item.get("encrypted_content")
        if blob is None:
            # NOTE: a client may replay the reasoning as plain reasoning_text parts instead.
            parts = item.get("content") or []
            texts = [p["text"] for p in parts if isinstance(p, dict)
                     and p.get("type") == "reasoning_text" and isinstance(p.get("text"), str)]
            return "".join(texts) or None
        text = self.sealer.open(blob)
        if text is None:
            self.ignored.add("input:reasoning.encrypted_content")
        return text

    async def messages(self, value: str | list[dict[str, Any]] | None) -> list[ChatMessage]:
        if value is None:
            return []
        if isinstance(value, str):
            return [ChatMessage(role="user", content=value)]
        out: list[ChatMessage] = []
        thought: str | None = None  # a replayed reasoning, for the next assistant turn
        for i, item in enumerate(value):
            where = f"input[{i}]"
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                role = item.get("role")
                role = ROLES.get(role) if isinstance(role, str) else None
                if role is None:
                    raise invalid(f"{where}.role must be user, assistant, system or developer",
                                  param="input")
                text, found = await _content(item.get("content"), where, self.caps,
                                             self.requested, self.images)
                msg = ChatMessage(role=role, content=text, images=found)
                if role == "assistant":
                    msg.reasoning_content, thought = thought, None
                out.append(msg)
            elif kind in CALLS:
                call = _call(item, str(kind), where)
                if out and out[-1].role == "assistant" and thought is None:
                    out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
                else:
                    out.append(ChatMessage(role="assistant", content="", tool_calls=[call],
                                           reasoning_content=thought))
                    thought = None
            elif kind in OUTPUTS:
                # NOTE: Codex CLI 0.171 sends outputs of its own making (the goal it keeps,
                # `name` "goal_objective", namespace "agent") with a name and no call_id: a
                # tool result all the same, named as a template prints one.
                call_id, name = item.get("call_id"), item.get("name")
                if not isinstance(call_id, str) and not (call_id is None
                                                         and isinstance(name, str)):
                    raise invalid(f"{where}: a {kind} needs a string call_id, or, without "
                                  "one, the name of its tool", param="input")
                if call_id is None and item.get("namespace") is not None:
                    # NOTE: the template prints a result under its tool's name alone.
                    self.ignored.add(f"input:{kind}.namespace")
                text, found = await _content(item.get("output"), where, self.caps,
                                             self.requested, self.images)
                out.append(ChatMessage(role="tool", content=text, tool_call_id=call_id,
                                       name=name if call_id is None else None, images=found))
            elif kind == "reasoning":
                thought = self._reasoning(item)
            elif isinstance(kind, str) and kind.endswith(("_call", "_call_output")):
                self.ignored.add(f"input:{kind}")
            else:
                raise invalid(f"{where}: input items of type {kind!r} are not supported by "
                              "this server", param="input")
        return out


async def input_messages(value: str | list[dict[str, Any]] | None, caps: Capabilities,
                         requested: str, images: Images) -> list[ChatMessage]:
    """The input as chat messages, for a caller without a request (what is left out is lost
    with the throw-away `Ignored`)."""
    return await InputReader(caps, requested, images, Sealer(), Ignored()).messages(value)
