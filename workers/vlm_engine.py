"""The vision engine (role `vlm`): chat with images through a vision-language model.

On GPU and CPU it is the continuous-batching engine (workers/batch_engine.py) over a
ContinuousBatchingPipeline loaded from a VLM's IR folder (OpenVINO GenAI then runs its vision
encoder too): requests go in with `add_request(id, prompt, images, config)`, many at once,
with the same streaming, abort, deadline, structured output, tools and fault hooks as the
`llm` role. On an NPU it is one VLMPipeline, one request and one image at a time (what OpenVINO
Model Server documents for VLMs on NPU).

Images arrive as encoded files (`ChatMessage.images`, checked by the gateway); the engine
decodes them with Pillow into the uint8 [1, H, W, 3] tensors GenAI takes, and places each in
the prompt with GenAI's universal tag `<ov_genai_image_N>` (GenAI swaps it for the model's own
image token and the image's features).

Token accounting: what one image costs in prompt tokens is measured once at warm-up (the
pipeline's own count of a prompt with one image, less the prompt's text). A request is counted
as GenAI builds it: the text between images tokenized piece by piece (a model's image token is
a special token, which splits the text there), plus that cost per image; `/tokenize` counts
the same way. Exact for models that give every image the same number of tokens (LLaVA-1.5, the
test model: the tests compare it with the pipeline's own count); for models that tile or
resize images by their size (Qwen2-VL, LLaVA-NeXT, Phi-3.5-vision) it is the cost of a
warm-up-sized (336x336) image.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import openvino as ov
import openvino_genai as ov_genai
from PIL import Image

from npu_proxy.protocol.config import WorkerSpec
from npu_proxy.protocol.messages import ErrorCode, Failed, Generate, SamplingParams, Tokenize
from npu_proxy.workers.batch_engine import BatchEngine, scheduler_config
from npu_proxy.workers.engine import Emit
from npu_proxy.workers.generation.active import Active, TokenizedRequest
from npu_proxy.workers.generation.engine_base import TokenStreamer
from npu_proxy.workers.generation.prompting import Prompting
from npu_proxy.workers.generation.sampling import generation_config

log = logging.getLogger(__name__)

# The most pixels one decoded image may have (a decompression bomb is refused unread).
MAX_PIXELS = 40_000_000
# The size of the warm-up image that measures an image's cost in tokens.
PROBE_SIZE = 336


class BadImage(ValueError):
    """An image the worker cannot decode."""


def image_tensor(data: bytes) -> ov.Tensor:
    """An encoded image file → the uint8 [1, H, W, 3] RGB tensor GenAI takes."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_PIXELS:
                raise BadImage(f"image is {img.width}x{img.height} pixels; at most "
                               f"{MAX_PIXELS} pixels are taken")
            pixels = np.asarray(img.convert("RGB"), dtype=np.uint8)
    except BadImage:
        raise
    except Exception as exc:  # NOTE: Pillow raises many kinds for a corrupt file
        raise BadImage(f"image cannot be decoded: {exc}") from None
    return ov.Tensor(np.ascontiguousarray(pixels[None]))


def tag_error(exc: Exception) -> str:
    """GenAI's refusal of a prompt's images, without its source location: e.g. a text that
    holds an image tag of its own (`<image>`, `<ov_genai_image_0>`)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = lines[-1] if lines else type(exc).__name__
    return f"the images cannot be placed in this prompt: {reason}"


def image_tag(index: int) -> str:
    """GenAI's universal image tag for the prompt's index-th image."""
    return f"<ov_genai_image_{index}>"


class VlmPrompting(Prompting):
    """Prompting with images: rendering places one marker per image before its message's text.

    `render` (what the checks and /tokenize count) puts `MARK` where an image goes; `encode`
    tokenizes the text between marks apart (as GenAI does around a model's image token, a
    special token) and counts each mark as `image_tokens` tokens (ids `IMAGE_ID`).
    `render_tagged` puts GenAI's image tags there instead: what the pipeline is given.
    """

    # NOTE: a client's text holding MARK only makes its own prompt count longer.
    MARK = "\x00image\x00"
    IMAGE_ID = 0

    def __init__(self, tokenizer: ov_genai.Tokenizer, context_length: int,
                 chat_template: str = "") -> None:
        super().__init__(tokenizer, context_length, chat_template)
        # Measured at warm-up (VlmEngine.warm_up).
        self.image_tokens = 1

    def _history(self, msg: Generate | Tokenize, tag: Callable[[int], str]
                 ) -> list[dict[str, Any]]:
        history = []
        seen = 0
        for m in msg.messages or []:
            entry = msgspec.to_builtins(m)
            images = entry.pop("images", [])
            if images:
                tags = "".join(tag(seen + i) for i in range(len(images)))
                entry["content"] = tags + entry.get("content", "")
                seen += len(images)
            history.append(entry)
        return history

    def _render(self, msg: Generate | Tokenize, tag: Callable[[int], str]) -> str:
        if msg.messages is None:
            return msg.prompt or ""
        opening = msg.add_generation_prompt if isinstance(msg, Tokenize) else True
        return str(self.tokenizer.apply_chat_template(
            self._history(msg, tag), add_generation_prompt=opening, tools=msg.tools or None,
            extra_context=msg.template_vars or None))

    def render(self, msg: Generate | Tokenize) -> str:
        return self._render(msg, lambda _: self.MARK)

    def render_tagged(self, msg: Generate | Tokenize) -> str:
        return self._render(msg, image_tag)

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray[Any, Any]:
        pieces = text.split(self.MARK)
        image = np.full((1, self.image_tokens), self.IMAGE_ID, dtype=np.int64)
        parts: list[np.ndarray[Any, Any]] = []
        for i, piece in enumerate(pieces):
            if i:
                parts.append(image)
            if piece or (i == 0 and add_special_tokens):
                parts.append(super().encode(piece, add_special_tokens and i == 0))
        if not parts:
            return np.zeros((1, 0), dtype=np.int64)
        return np.concatenate(parts, axis=1)


def _images(msg: Generate | Tokenize) -> list[bytes]:
    return [image for m in msg.messages or [] for image in m.images]


@dataclass
class VlmTokenizedRequest(TokenizedRequest):
    """A request with its images decoded and its prompt carrying GenAI's image tags."""

    text: str = ""
    images: list[ov.Tensor] = field(default_factory=list)


class VlmEngine(BatchEngine):
    """Continuous batching over a VLM's ContinuousBatchingPipeline (GPU, CPU); on an NPU a
    VLMPipeline, one request and one image at a time."""

    def __init__(self, spec: WorkerSpec, model_path: str, context_length: int, emit: Emit) -> None:
        super().__init__(spec, model_path, context_length, emit)
        # One VLMPipeline, one request at a time (the NPU's way; settable for tests on CPU).
        self.on_npu = spec.device.upper().startswith("NPU")

    def prompt_limit(self) -> tuple[int, bool]:
        if self.on_npu:
            return self.spec.max_prompt_len, True
        return super().prompt_limit()

    def room(self, prompt_tokens: int) -> int:
        if self.on_npu:
            return min(self.context_length,
                       self.spec.max_prompt_len + self.spec.min_response_len) - prompt_tokens
        return super().room(prompt_tokens)

    def load(self, properties: dict[str, Any]) -> None:
        if self.on_npu:
            # NOTE: VLMPipeline's streamer gets token ids only: no logprobs (UNSUPPORTED).
            self.gives_logprobs = False
            props = dict(properties)
            if self.spec.device.upper().startswith("NPU"):
                props["MAX_PROMPT_LEN"] = self.spec.max_prompt_len
                props["MIN_RESPONSE_LEN"] = self.spec.min_response_len
            self.pipe = ov_genai.VLMPipeline(self.model_path, self.spec.device, **props)
            self.base_config = self.pipe.get_generation_config()
        else:
            self.pipe = ov_genai.ContinuousBatchingPipeline(
                self.model_path, scheduler_config(self.spec, self.context_length),
                self.spec.device, properties)
            self.base_config = self.pipe.get_config()
        self.prompting = VlmPrompting(self.pipe.get_tokenizer(), self.context_length,
                                      self.chat_template)
        # NOTE: the engine renders the chat itself (with the image tags placed).
        self.base_config.apply_chat_template = False

    def warm_up(self) -> None:
        """Compile both models with one image, and measure what an image costs in tokens."""
        assert isinstance(self.prompting, VlmPrompting)
        cfg = generation_config(SamplingParams(max_tokens=1, temperature=0.0),
                                self.base_config, 1)
        cfg.apply_chat_template = False
        probe = ov.Tensor(np.full((1, PROBE_SIZE, PROBE_SIZE, 3), 127, dtype=np.uint8))
        text = "Hello"
        with_image = image_tag(0) + text
        if self.on_npu:
            result = self.pipe.generate(with_image, images=[probe], generation_config=cfg)
        else:
            result = self.pipe.generate([with_image], images=[[probe]],
                                        generation_config=[cfg])[0]
        total = int(result.perf_metrics.get_num_input_tokens())
        plain = int(self.prompting.encode(text).shape[1])
        self.prompting.image_tokens = max(1, total - plain)
        log.info("an image costs %d prompt tokens", self.prompting.image_tokens)

    # --- receiver/engine thread: checks ----------------------------------------------------

    def _prepare(self, req: Generate) -> TokenizedRequest | None:
        assert isinstance(self.prompting, VlmPrompting)
        encoded = _images(req)
        if self.on_npu and len(encoded) > 1:
            self._refuse(Failed(id=req.id, seq=0, code=ErrorCode.UNSUPPORTED,
                                message=f"worker {self.spec.name} (NPU) takes one image per "
                                        f"request, this one has {len(encoded)}",
                                retry_elsewhere=True))
            return None
        if req.prompt_ids is not None:
            self._refuse(Failed(id=req.id, seq=0, code=ErrorCode.UNSUPPORTED,
                                message=f"worker {self.spec.name} (a vision model) takes text "
                                        "prompts, not token ids", retry_elsewhere=True))
            return None
        if req.resume:
            # NOTE: the VLM pipeline reads the prompt as text: it cannot continue from ids.
            self._refuse(Failed(id=req.id, seq=0, code=ErrorCode.UNSUPPORTED,
                                message=f"worker {self.spec.name} cannot continue a generation "
                                        "from its tokens", retry_elsewhere=True))
            return None
        # NOTE: the checks count the images without decoding them; pixels are decoded only
        # for a request that passed them.
        ready = super()._prepare(req)
        if ready is None:
            return None
        try:
            # NOTE: of the messages kept: a truncated history drops its images too.
            images = [image_tensor(data) for data in _images(ready.req)]
            text = self.prompting.render_tagged(ready.req)
        except Exception as exc:  # a corrupt image (BadImage); the template rendered before
            self._refuse(Failed(id=req.id, seq=0, code=ErrorCode.BAD_REQUEST, message=str(exc)))
            return None
        ready.config.apply_chat_template = False
        return VlmTokenizedRequest(req=ready.req, ids=ready.ids, config=ready.config,
                           received=ready.received, context=ready.context,
                           dropped=ready.dropped, text=text, images=images)

    # --- engine thread -----------------------------------------------------------------------

    def _add_request(self, ready: TokenizedRequest) -> Any:
        assert isinstance(ready, VlmTokenizedRequest)
        try:
            return self.pipe.add_request(self._handle_id(), ready.text, ready.images,
                                         ready.config)
        except Exception as exc:
            raise ValueError(tag_error(exc)) from None

    def _step(self) -> bool:
        if not self.on_npu:
            return super()._step()
        self._drain_inbox()
        taken = self._next()
        if taken is None:
            return False
        ready, active = taken
        if active is not None:
            assert isinstance(ready, VlmTokenizedRequest)
            self._generate_one(ready, active)
        return True

    @property
    def blocking(self) -> bool:
        return bool(self._active)

    def _generate_one(self, ready: VlmTokenizedRequest, active: Active) -> None:
        """The NPU path: one VLMPipeline.generate, tokens streamed as they come."""
        req = ready.req
        self.announce()
        streamer = TokenStreamer(self, active)
        try:
            self.pipe.generate(ready.text, images=ready.images, generation_config=ready.config,
                               streamer=streamer)
        except Exception as exc:
            log.exception("generation failed", extra={"request_id": req.log_id or req.id})
            self._active.pop(req.id, None)
            # NOTE: a prompt whose images cannot be placed fails before its first token.
            code = ErrorCode.BAD_REQUEST if not active.completion_tokens else ErrorCode.INTERNAL
            self._refuse(Failed(id=req.id, seq=active.seq, code=code,
                                message=tag_error(exc) if code == ErrorCode.BAD_REQUEST
                                else f"generation failed: {exc}"))
            return
        if not active.cancelled and active.completion_tokens >= ready.config.max_new_tokens:
            active.finish_reason = "length"
        self._active.pop(req.id, None)
        self._finish(active)

