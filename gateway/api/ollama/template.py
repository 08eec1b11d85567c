"""The `template` field of Ollama's /api/generate: a Go template, applied in the gateway.

Only the subset that single-prompt templates use is supported: text, `{{ .System }}`,
`{{ .Prompt }}`, `{{ .Response }}`, `{{ if .X }}…{{ else }}…{{ end }}`, comments and the
`{{-`/`-}}` whitespace trims. Like Ollama, the output stops at `{{ .Response }}`: the model
writes the response from there. Anything else (`.Messages`, `range`, functions) is refused
with a 400 that names the action, rather than rendered wrongly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from npu_proxy.gateway.api.request_path import GatewayError, invalid

_SPACE = " \t\r\n"


class _Action(NamedTuple):
    start: int
    end: int
    trim_left: bool
    body: str
    trim_right: bool


def _actions(template: str) -> Iterator[_Action]:
    """Each `{{ ... }}` with its trim markers, found by plain scanning.

    NOTE: a regex with lazy `.*?` between two `\\s*` backtracked for minutes on "{{" and a
    few thousand spaces (issue 14); this is linear in the template's length.
    """
    pos = 0
    while (start := template.find("{{", pos)) >= 0:
        end = template.find("}}", start + 2)
        if end < 0:
            return
        body = template[start + 2:end]
        trim_left = len(body) >= 2 and body[0] == "-" and body[1] in _SPACE
        trim_right = len(body) >= 2 and body[-1] == "-" and body[-2] in _SPACE
        body = body[2 if trim_left else 0:len(body) - 2 if trim_right else len(body)]
        yield _Action(start, end + 2, trim_left, body.strip(), trim_right)
        pos = end + 2
_FIELDS = ("System", "Prompt", "Response")


def _field(word: str) -> str | None:
    name = word.removeprefix(".")
    return name if word.startswith(".") and name in _FIELDS else None


def render(template: str, system: str, prompt: str, limit: int | None = None) -> str:
    """The prompt `template` makes of `system` and `prompt`; a 400 when it would be longer
    than `limit` characters (`max_prompt_chars`), found before it is built.

    NOTE: "{{ .Prompt }}" x 2,000 with a 64 KiB prompt (an 89 KiB body) once built a 131 M
    character string before the prompt limit was checked: the pieces are counted as they
    are collected (references, not copies) and joined only when their total fits.
    """
    values = {"System": system, "Prompt": prompt, "Response": ""}
    out: list[str] = []
    size = 0

    def add(piece: str) -> None:
        nonlocal size
        size += len(piece)
        if limit is not None and size > limit:
            raise invalid(f"prompt is too long: the template renders more than {limit} "
                          "characters (max_prompt_chars)", param="template")
        out.append(piece)
    # One entry per open `if`: (output active outside it, its condition).
    stack: list[tuple[bool, bool]] = []
    active = True
    trim_next = False
    pos = 0

    def unsupported(action: str) -> Exception:
        return invalid(f"template: {{{{ {action} }}}} is not supported here; supported are "
                       "{{ .System }}, {{ .Prompt }}, {{ .Response }}, {{ if .X }}, "
                       "{{ else }} and {{ end }}", param="template")

    for m in _actions(template):
        text = template[pos:m.start]
        text = text.lstrip() if trim_next else text
        text = text.rstrip() if m.trim_left else text
        if active:
            add(text)
        trim_next = m.trim_right
        pos = m.end
        action = m.body
        if action.startswith("/*"):
            continue
        words = action.split()
        if len(words) == 2 and words[0] == "if" and (name := _field(words[1])):
            cond = bool(values[name])
            stack.append((active, cond))
            active = active and cond
        elif words == ["else"] and stack:
            outer, cond = stack[-1]
            active = outer and not cond
        elif words == ["end"] and stack:
            active = stack.pop()[0]
        elif len(words) == 1 and (name := _field(words[0])):
            if name == "Response":
                return "".join(out)
            if active:
                add(values[name])
        else:
            raise unsupported(action)
    if stack:
        raise invalid("template: an {{ if }} has no {{ end }}", param="template")
    tail = template[pos:]
    if active:
        add(tail.lstrip() if trim_next else tail)
    return "".join(out)


def supported(template: str) -> bool:
    """Whether `render` takes this template (only the subset above)."""
    try:
        render(template, "", "")
    except GatewayError:
        return False
    return True
