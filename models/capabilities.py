"""What a served model can do, from its kind and its chat template: the one source of
Ollama's `capabilities` (/api/show, /api/tags), the `/v1/models` cards, and every 400 that
refuses a request the model cannot serve (tools, images, thinking, suffix, embeddings).

Each capability is what this server does with the model, not what its weights might do:
- `completion`: a text-generation model (`kind` "llm"); `embedding`: an embedding model;
  `rerank`: a reranking model (`kind` "rerank", POST /v1/rerank); `transcription`: a
  speech-recognition model (`kind` "asr", POST /v1/audio/transcriptions); `speech`: a
  text-to-speech model (`kind` "tts", POST /v1/audio/speech).
- `tools`: every text-generation model takes tools, natively when its template has a `tools`
  slot (`native_tools`), else through the fallback prompt (gateway/content/tools.py).
- `insert` (a `suffix`, fill-in-the-middle): the vocabulary has a fill-in-the-middle form's
  three tokens (`FIM_FORMS`: Qwen2.5-Coder's, StarCoder's, DeepSeek-Coder's); the prompt is
  then `<prefix token>{prompt}<suffix token>{suffix}<middle token>`, as Ollama's templates for
  these models write it when `.Suffix` is set (no chat template, no system prompt).
- `vision`: a vision-language model (kind "vlm": what a `vlm` worker serves, or a pulled
  model whose files have a vision encoder) takes images; the `llm`/`npu` workers run text
  pipelines, so their models take none, whatever their template.
- `thinking`: the chat template shows how the model thinks (`reasoning_format`): it writes
  `<think>` (or cuts a past answer at `</think>`) or switches `enable_thinking` (Qwen3,
  DeepSeek-R1, QwQ...), or it has harmony's analysis channel (gpt-oss). The gateway then
  splits the reasoning from the answer (gateway/content/reasoning.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

COMPLETION = "completion"
TOOLS = "tools"
INSERT = "insert"
VISION = "vision"
EMBEDDING = "embedding"
RERANK = "rerank"
TRANSCRIPTION = "transcription"
SPEECH = "speech"
THINKING = "thinking"

# How each capability is named in a refusal ("model 'x' does not support ...").
WHAT = {COMPLETION: "text generation", TOOLS: "tools", INSERT: "insert (a suffix)",
        VISION: "images", EMBEDDING: "embeddings", THINKING: "thinking",
        RERANK: "reranking", TRANSCRIPTION: "transcription",
        SPEECH: "speech"}


OPEN, CLOSE, CHANNEL = "<think>", "</think>", "<|channel|>"
# How far after `add_generation_prompt` a template's opening `<think>` is looked for.
OPENING_WINDOW = 160


class Style(enum.Enum):
    THINK = "think"
    HARMONY = "harmony"


@dataclass(frozen=True)
class ReasoningFormat:
    style: Style
    # The generation prompt already opened `<think>`: the output starts inside the thinking.
    opened: bool = False


def reasoning_format(chat_template: str) -> ReasoningFormat | None:
    """How a model with this chat template thinks, or None if it does not. NOTE: read from
    the template's text, in time linear in it (a created model's template is client text)."""
    if CHANNEL in chat_template and "analysis" in chat_template:
        return ReasoningFormat(Style.HARMONY)
    if not any(mark in chat_template for mark in (OPEN, CLOSE, "enable_thinking")):
        return None
    opened = False
    at = chat_template.find("add_generation_prompt")
    while at >= 0 and not opened:
        window = chat_template[at:at + OPENING_WINDOW]
        opened = OPEN in window.split("endif", 1)[0] and "enable_thinking" not in window
        at = chat_template.find("add_generation_prompt", at + 1)
    return ReasoningFormat(Style.THINK, opened)


@dataclass(frozen=True)
class FimForm:
    """A model's fill-in-the-middle tokens, in the prefix-suffix-middle order it was trained
    on."""
    prefix: str
    suffix: str
    middle: str

    def prompt(self, before: str, after: str) -> str:
        return f"{self.prefix}{before}{self.suffix}{after}{self.middle}"


FIM_FORMS = (
    FimForm("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    FimForm("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder(2), Granite Code
    FimForm("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>",
            "<\uff5cfim\u2581end\uff5c>"),  # DeepSeek-Coder
)


def fim_form(specials: set[str]) -> FimForm | None:
    """The fill-in-the-middle form whose three tokens are all among `specials` (the
    vocabulary's special or added tokens), or None."""
    return next((f for f in FIM_FORMS if {f.prefix, f.suffix, f.middle} <= specials), None)


@dataclass(frozen=True)
class Capabilities:
    kind: str  # "llm", "vlm", "embed", "rerank", "asr" or "tts"
    native_tools: bool = False
    fim: FimForm | None = None
    vision: bool = False
    reasoning: ReasoningFormat | None = None

    @property
    def insert(self) -> bool:
        return self.fim is not None

    @property
    def thinking(self) -> bool:
        return self.reasoning is not None

    @property
    def names(self) -> list[str]:
        """Ollama's `capabilities` list, in Ollama's order."""
        if self.kind == "embed":
            return [EMBEDDING]
        if self.kind == "rerank":
            return [RERANK]
        if self.kind == "asr":
            return [TRANSCRIPTION]
        if self.kind == "tts":
            return [SPEECH]
        flags = ((INSERT, self.insert), (VISION, self.vision), (THINKING, self.thinking))
        return [COMPLETION, TOOLS] + [name for name, on in flags if on]

    def __contains__(self, name: object) -> bool:
        return name in self.names


def capabilities(kind: str, chat_template: str, fim: FimForm | None = None) -> Capabilities:
    """The capabilities of a model of this kind ("llm", "vlm", "embed", "rerank", "asr", "tts"),
    template ("" when unknown) and fill-in-the-middle form. Callable for any model, also one
    made by /api/create from its template."""
    if kind in ("embed", "rerank", "asr", "tts"):
        return Capabilities(kind=kind)
    return Capabilities(kind="llm", native_tools=template_supports_tools(chat_template),
                        fim=fim if kind == "llm" else None, vision=kind == "vlm",
                        reasoning=reasoning_format(chat_template))


def template_supports_tools(chat_template: str) -> bool:
    """Does the chat template place tools itself (Qwen2.5, Llama 3.x...)?"""
    return "tools" in chat_template
