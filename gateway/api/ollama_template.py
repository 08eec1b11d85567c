"""The `template` field of Ollama's /api/generate: a Go template, applied in the gateway.

Only the subset that single-prompt templates use is supported: text, `{{ .System }}`,
`{{ .Prompt }}`, `{{ .Response }}`, `{{ if .X }}…{{ else }}…{{ end }}`, comments and the
`{{-`/`-}}` whitespace trims. Like Ollama, the output stops at `{{ .Response }}`: the model
writes the response from there. Anything else (`.Messages`, `range`, functions) is refused
with a 400 that names the action, rather than rendered wrongly.
"""

from __future__ import annotations

import re

from gateway.core.errors import invalid

_ACTION = re.compile(r"\{\{(-[ \t\r\n])?\s*(.*?)\s*([ \t\r\n]-)?\}\}", re.S)
_FIELDS = ("System", "Prompt", "Response")


def _field(word: str) -> str | None:
    name = word.removeprefix(".")
    return name if word.startswith(".") and name in _FIELDS else None


def render(template: str, system: str, prompt: str) -> str:
    values = {"System": system, "Prompt": prompt, "Response": ""}
    out: list[str] = []
    # One entry per open `if`: (output active outside it, its condition).
    stack: list[tuple[bool, bool]] = []
    active = True
    trim_next = False
    pos = 0

    def unsupported(action: str) -> Exception:
        return invalid(f"template: {{{{ {action} }}}} is not supported here; supported are "
                       "{{ .System }}, {{ .Prompt }}, {{ .Response }}, {{ if .X }}, "
                       "{{ else }} and {{ end }}", param="template")

    for m in _ACTION.finditer(template):
        text = template[pos:m.start()]
        text = text.lstrip() if trim_next else text
        text = text.rstrip() if m.group(1) else text
        if active:
            out.append(text)
        trim_next = bool(m.group(3))
        pos = m.end()
        action = m.group(2)
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
                out.append(values[name])
        else:
            raise unsupported(action)
    if stack:
        raise invalid("template: an {{ if }} has no {{ end }}", param="template")
    tail = template[pos:]
    if active:
        out.append(tail.lstrip() if trim_next else tail)
    return "".join(out)
