"""The reasoning splitter (gateway/content/reasoning.py) on recorded outputs of thinking models,
whole and streamed in every split, and the formats read from chat templates."""

from __future__ import annotations

import pytest

from npu_proxy.gateway.content.reasoning import ReasoningSplitter, split_text
from npu_proxy.models.capabilities import ReasoningFormat, Style, reasoning_format

THINK = ReasoningFormat(Style.THINK)
OPENED = ReasoningFormat(Style.THINK, opened=True)
HARMONY = ReasoningFormat(Style.HARMONY)

# Recorded shapes of real outputs (Qwen3-8B, DeepSeek-R1-Distill-Qwen-7B, gpt-oss-20b).
QWEN3 = ("<think>\nOkay, the user asks for the capital of France. That is Paris, a well-known "
         "fact.\n</think>\n\nThe capital of France is **Paris**.")
QWEN3_NO_THINK = "<think>\n\n</think>\n\nThe capital of France is Paris."
R1 = ("Okay, so I need to add 2 and 3. 2 + 3 = 5. Let me double-check: yes, 5.\n</think>\n\n"
      "2 + 3 = **5**.")
GPT_OSS = ("<|channel|>analysis<|message|>User asks: capital of France. Answer: Paris."
           "<|end|><|start|>assistant<|channel|>final<|message|>The capital of France is "
           "Paris.<|return|>")
CASES = [
    (QWEN3, THINK, ("Okay, the user asks for the capital of France. That is Paris, a "
                    "well-known fact.", "The capital of France is **Paris**.")),
    (QWEN3_NO_THINK, THINK, ("", "The capital of France is Paris.")),
    (R1, OPENED, ("Okay, so I need to add 2 and 3. 2 + 3 = 5. Let me double-check: yes, 5.",
                  "2 + 3 = **5**.")),
    (GPT_OSS, HARMONY, ("User asks: capital of France. Answer: Paris.",
                        "The capital of France is Paris.")),
    # no thinking at all, and thinking cut off by max_tokens
    ("  Paris is the capital.", THINK, ("", "  Paris is the capital.")),
    ("<think>\nStill thinking about </thi", THINK, ("Still thinking about </thi", "")),
    ("Plain text < think > <|chan", HARMONY, ("", "Plain text < think > <|chan")),
]


@pytest.mark.parametrize(("output", "fmt", "expected"), CASES)
def test_recorded_outputs_split_alike_in_every_split(
        output: str, fmt: ReasoningFormat, expected: tuple[str, str]) -> None:
    assert split_text(output, fmt) == expected
    for i in range(len(output) + 1):
        for j in range(i, len(output) + 1, 7):
            splitter = ReasoningSplitter(fmt)
            pieces = [splitter.feed(output[:i]), splitter.feed(output[i:j]),
                      splitter.feed(output[j:]), splitter.finish()]
            got = ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces))
            assert got == expected, (i, j)


def test_one_character_at_a_time_streams_the_thinking_before_the_answer() -> None:
    splitter = ReasoningSplitter(THINK)
    seen = [splitter.feed(c) for c in QWEN3] + [splitter.finish()]
    kinds = [("t" if t else "") + ("a" if a else "") for t, a in seen if t or a]
    assert kinds == sorted(kinds, reverse=True) and "ta" not in kinds


QWEN3_TEMPLATE = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if "
                  "enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n"
                  "</think>\\n\\n' }}{%- endif %}{%- endif %}")
R1_TEMPLATE = "{% if add_generation_prompt %}{{'<\uff5cAssistant\uff5c><think>\\n'}}{% endif %}"
HARMONY_TEMPLATE = "{{- '<|start|>assistant<|channel|>analysis<|message|>' }}"


def test_formats_from_chat_templates() -> None:
    assert reasoning_format(QWEN3_TEMPLATE) == THINK
    assert reasoning_format(R1_TEMPLATE) == OPENED
    assert reasoning_format(HARMONY_TEMPLATE) == HARMONY
    assert reasoning_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
