"""What the tool-call tests share (test_tools_auto.py, test_tools_unmarked.py): a schema the
135M model does not meet on its own, and the calls of an OpenAI chat, streamed or not."""

from __future__ import annotations

from typing import Any

import openai

# An integer enum and a patterned string: measured, SmolLM2-135M writes the schema's keywords
# as arguments unless its output is held to the schema.
LEVEL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "level": {"type": "integer", "enum": [3, 7]},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    },
    "required": ["level", "code"],
}


def chat_calls(oai: openai.OpenAI, kwargs: dict[str, Any], stream: bool) -> tuple[list[str], str]:
    """The names of the tool calls an OpenAI chat returned, and their arguments joined; a
    whole reply must end with finish_reason tool_calls."""
    if stream:
        names, args = [], ""
        for chunk in oai.chat.completions.create(stream=True, **kwargs):
            for delta in (c.delta.tool_calls or [] for c in chunk.choices):
                for call in delta:
                    if call.function and call.function.name:
                        names.append(call.function.name)
                    args += (call.function.arguments or "") if call.function else ""
        return names, args
    reply = oai.chat.completions.create(**kwargs)
    calls = reply.choices[0].message.tool_calls or []
    assert reply.choices[0].finish_reason == "tool_calls", reply
    return ([c.function.name for c in calls],  # type: ignore[union-attr]
            "".join(c.function.arguments for c in calls))  # type: ignore[union-attr]
