"""The message catalogue exchanged between the gateway and the device workers.

Every message is a tagged msgspec Struct encoded as MessagePack. Fields are only ever
appended and new fields carry defaults, so a gateway and a freshly restarted worker of a
slightly different version still understand each other. Hot-path frames are `array_like`.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from npu_proxy.protocol.liveness import Heartbeat
from npu_proxy.protocol.speech import Speech, SpeechChunk, Synthesize, Transcribe, Transcription
from npu_proxy.protocol.timings import Timings


class ErrorCode(enum.IntEnum):
    """Why a request failed; the gateway maps each to a status and body per API."""

    INTERNAL = 1
    BAD_REQUEST = 2
    PROMPT_TOO_LONG = 3
    MODEL_NOT_LOADED = 4
    DEADLINE_EXCEEDED = 5
    ABORTED = 6
    WORKER_LOST = 7
    QUEUE_FULL = 8
    NOT_READY = 9
    # The worker's pipeline cannot do what the request asks (e.g. logprobs on the NPU's
    # LLMPipeline); another worker may.
    UNSUPPORTED = 10


class ToolTag(msgspec.Struct, frozen=True, omit_defaults=True):
    """One way a call is written: `begin`, then a value matching `schema` (a JSON schema),
    then `end`."""

    begin: str
    schema: str
    end: str
    # A newline may come before and after the value (a call between marker lines).
    padded: bool = False


class ToolTags(msgspec.Struct, frozen=True, omit_defaults=True):
    """Tool calls under tool_choice auto: the output is free, but once the model writes one
    of `triggers` what follows must complete one of `tags` (OpenVINO GenAI's triggered
    structural tags); after it the output is free again. Each tag's begin starts with a
    trigger.

    A template with call markers (`<tool_call>`): one tag holds a call of any offered tool
    (gateway/content/tools/forcing.py `auto_call_schema`) between the markers, and, since
    models offered them still write calls as bare or fenced JSON, `{"name"` is a second
    trigger. Bare JSON, and a template that writes it (Llama 3.x): each tool has its tag,
    `{"name": "<tool>", "arguments": ` (or `"parameters"`) + its parameters + `}`."""

    triggers: tuple[str, ...]
    tags: tuple[ToolTag, ...]
    # At most one call (parallel tool calls off): the output ends after it.
    single: bool = False


class SamplingParams(msgspec.Struct, omit_defaults=True, frozen=True):
    """The one internal parameter set every API is mapped to (see gateway/content/params.py).
    Immutable: a value derived from another is a new one (msgspec.structs.replace)."""

    # None: the worker's default cap (workers/generation/sampling.py DEFAULT_MAX_TOKENS). Any
    # number is clamped to the room the prompt leaves in the context, and the generation
    # then ends with finish reason "length", as Ollama and llama.cpp's server do.
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = []
    # A JSON schema (serialised) the output must satisfy; "{}"-like generic object for json mode.
    json_schema: str | None = None
    # Ollama's options.num_ctx: a context smaller than the model's is the limit of this
    # request's prompt and output; a larger one cannot be had (Accepted.context says so).
    num_ctx: int | None = None
    # vLLM extension: keep generating past the end-of-sequence token (benchmarks).
    ignore_eos: bool = False
    # Keep a matched stop string at the end of the text, so the gateway can tell which one
    # ended the generation (Anthropic's stop_sequence) and remove it itself.
    include_stop: bool = False
    # Send each generated token's log-probability, text and bytes (Delta.logprobs).
    logprobs: bool = False
    # Send the prompt's tokens with their log-probabilities (Delta.prompt, before any generated
    # token): OpenAI completions' echo with logprobs, vLLM's prompt_logprobs. With it,
    # max_tokens may be 0: the prompt is scored and nothing generated.
    prompt_logprobs: bool = False
    # A regular expression the output must match (vLLM's structured_outputs.regex).
    regex: str | None = None
    # Tool calls constrained once begun (tool_choice auto); never with json_schema or regex.
    tool_tags: ToolTags | None = None


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str = ""
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # The message's images: each an image file's own bytes (PNG, JPEG, WebP, GIF, BMP), in the
    # order the client sent them, checked by the gateway (gateway/content/images.py); only a `vlm`
    # worker takes them (workers/vlm_engine.py).
    images: list[bytes] = []
    # An assistant turn's reasoning, replayed by a client (Responses `reasoning` items): chat
    # templates of thinking models read it as `message.reasoning_content` (Qwen3's does).
    reasoning_content: str | None = None


def joined_system(texts: list[str]) -> str:
    """System texts as one system prompt, in their order (the Anthropic dialect's system turns
    inside `messages`; a worker's template that refuses a system turn after the first)."""
    return "\n\n".join(t for t in texts if t)


# --- gateway -> worker -------------------------------------------------------------------


class Generate(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    id: str
    model: str
    params: SamplingParams
    # Absolute wall-clock time (time.time()) after which the worker stops the request.
    deadline: float
    messages: list[ChatMessage] | None = None
    # A raw prompt, sent to the model as is (no chat template).
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    # The id the client sees (X-Request-ID): for logs only, never a key. `id` is the gateway's
    # own, unique per request, so clients that reuse an id cannot cross-wire requests.
    log_id: str = ""
    # Extra variables for the chat template (e.g. enable_thinking; vLLM's chat_template_kwargs).
    template_vars: dict[str, Any] | None = None
    # When the messages do not fit the context with room for the reply, drop the oldest ones
    # (not the system messages, not the last user turn) until they do, instead of failing
    # with PROMPT_TOO_LONG (Ollama's chat `truncate`, the Responses API's truncation "auto").
    truncate: bool = False
    # The tokens this request already generated (and the client received) on a worker that
    # died: the worker reads them after the prompt and generates what follows, counting them
    # in completion_tokens and against max_tokens (gateway/core/resume.py).
    resume: list[int] = []
    # A raw prompt given as the model's token ids (OpenAI completions' `prompt` as a list of
    # integers), read as they are: no template, no tokenizer. Exclusive with prompt/messages.
    prompt_ids: list[int] | None = None


class Embed(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    id: str
    model: str
    texts: list[str]
    deadline: float
    truncate: bool = True
    # The id the client sees (X-Request-ID): for logs only, never a key. `id` is the gateway's
    # own, unique per request, so clients that reuse an id cannot cross-wire requests.
    log_id: str = ""


class Abort(msgspec.Struct, tag=True, array_like=True):
    id: str


class Tokenize(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    id: str
    model: str
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    # The id the client sees (X-Request-ID): for logs only, never a key. `id` is the gateway's
    # own, unique per request, so clients that reuse an id cannot cross-wire requests.
    log_id: str = ""
    # Send the token ids and their vocabulary entries back (TokenCount.tokens, .pieces).
    want_tokens: bool = False
    # Let the tokenizer add its special tokens (e.g. BOS); generation never does (the chat
    # template places them), so the default counts what a generation counts.
    add_special_tokens: bool = False
    # End the chat with the assistant's turn opening, as a generation does.
    add_generation_prompt: bool = True
    # Extra variables for the chat template, as in Generate.
    template_vars: dict[str, Any] | None = None


class Detokenize(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Token ids back to text (answered with `Detokenized`); with `specials`, the answer also
    names the tokenizer's special tokens (vLLM's /tokenizer_info)."""

    id: str
    model: str
    tokens: list[int]
    log_id: str = ""
    specials: bool = False


class Rerank(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Score each document against the query (answered with `Reranked`)."""

    id: str
    model: str
    query: str
    documents: list[str]
    deadline: float
    # False: a query-document pair longer than the model's max length fails the request
    # instead of being cut (the pipeline truncates the longer of the two first).
    truncate: bool = True
    # The id the client sees (X-Request-ID): for logs only, never a key.
    log_id: str = ""


WorkerRequest = (Generate | Embed | Abort | Tokenize | Detokenize | Rerank | Transcribe
                 | Synthesize)


# --- worker -> gateway -------------------------------------------------------------------


class Accepted(msgspec.Struct, tag=True, array_like=True):
    """Sent before the first token, so the gateway can set response headers."""

    id: str
    seq: int
    worker: str
    device: str
    prompt_tokens: int
    # The context this request runs in (the model's, or a smaller num_ctx), and how many of
    # its messages were dropped to fit it (Generate.truncate); 0 when unknown or none.
    context: int = 0
    dropped: int = 0
    # The deadline the worker holds the request to (wall clock): the Generate's, moved by
    # the time its prompt may take to read (WorkerSpec.min_prefill_rate); 0 = the Generate's.
    deadline: float = 0.0


class TokenLogprob(msgspec.Struct, array_like=True):
    """One generated token: its piece of the text, its exact bytes, its log-probability.

    The pieces of a generation's tokens concatenate to its text: a character split across
    tokens is the piece of the token that completes it (the others' piece is ""). `data` is
    the token's own bytes (empty for a special token, which is not part of the text).
    """

    text: str
    data: bytes
    logprob: float


class Delta(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    id: str
    seq: int
    text: str
    tokens: int
    # Only when the request asked (SamplingParams.logprobs): one entry per token of this
    # frame, whose pieces concatenate to `text`.
    logprobs: list[TokenLogprob] | None = None
    # The ids of this frame's tokens, whose text is `text`: what a resumption continues
    # from (Generate.resume).
    ids: list[int] = []
    # Only when the request asked (SamplingParams.prompt_logprobs), in a frame of its own
    # before the first generated token: one entry per prompt token (the chat template's
    # included), whose pieces concatenate to the prompt as the model read it; `ids` are then
    # the prompt's ids. The first token's logprob is NaN: nothing precedes it to predict it.
    prompt: list[TokenLogprob] | None = None


class Finished(msgspec.Struct, tag=True, array_like=True):
    id: str
    seq: int
    # "stop", "length", "abort" or "timeout".
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: Timings


class Failed(msgspec.Struct, tag=True, array_like=True):
    id: str
    seq: int
    code: ErrorCode
    message: str
    retry_elsewhere: bool = False
    prompt_tokens: int | None = None
    limit: int | None = None
    # PROMPT_TOO_LONG: the context of the worker that refused (the model's or num_ctx), and
    # for a prompt refused uncounted (prompt_tokens None) the least it can count.
    context: int | None = None
    floor: int | None = None


class Embeddings(msgspec.Struct, tag=True, array_like=True):
    """Vectors as raw little-endian float32 bytes of shape (rows, dims)."""

    id: str
    seq: int
    data: bytes
    rows: int
    dims: int
    prompt_tokens: list[int]  # each input's tokens embedded (after any truncation)
    timings: Timings
    # How many inputs were cut to the model's length (Embed.truncate), so the gateway says so.
    truncated: int = 0


class TokenCount(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    id: str
    seq: int
    count: int
    # Only when asked (Tokenize.want_tokens): the ids, and each one's vocabulary entry as text
    # (bytes that are no UTF-8 on their own as U+FFFD).
    tokens: list[int] | None = None
    pieces: list[str] | None = None


class Detokenized(msgspec.Struct, tag=True, array_like=True):
    id: str
    seq: int
    text: str
    # The special tokens' texts when asked (Detokenize.specials): eos_token, bos_token,
    # pad_token, those the tokenizer has.
    specials: dict[str, str] = {}


class Reranked(msgspec.Struct, tag=True, array_like=True):
    """One relevance score per document, in the request's order (the gateway sorts)."""

    id: str
    seq: int
    scores: list[float]
    # Tokens of each query-document pair the model read (after truncation).
    prompt_tokens: list[int]
    timings: Timings


WorkerReply = (Accepted | Delta | Finished | Failed | Embeddings | TokenCount | Detokenized
               | Heartbeat | Reranked | Transcription | SpeechChunk | Speech)
RequestFrame = (Accepted | Delta | Finished | Failed | Embeddings | TokenCount | Detokenized
                | Reranked | Transcription | SpeechChunk | Speech)

def request_decoder() -> msgspec.msgpack.Decoder[WorkerRequest]:
    """One decoder per receiving socket (decoders are not shared across threads)."""
    return msgspec.msgpack.Decoder(WorkerRequest)


def reply_decoder() -> msgspec.msgpack.Decoder[WorkerReply]:
    return msgspec.msgpack.Decoder(WorkerReply)


def encode(msg: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(msg)
