"""The serial engine (role `npu`): one stateful LLMPipeline, one request at a time, fixed limits.

An NPU pipeline is compiled for a fixed prompt length (MAX_PROMPT_LEN) plus a minimum
response length (MIN_RESPONSE_LEN) and serves one request at a time. Requests are checked
the moment they arrive (exact token count with the model's tokenizer) so a prompt that is too
long is refused at once with `retry_elsewhere`, even while another request is generating;
accepted ones wait in the engine's bounded queue (max_queue, see
workers/generation/engine_base.py). The same role runs on CPU in tests, with the same limits
configured, to exercise this code where no NPU exists.
"""

from __future__ import annotations

import logging
from typing import Any

import openvino as ov
import openvino_genai as ov_genai

from npu_proxy.protocol.messages import ErrorCode, Failed
from npu_proxy.workers.generation.active import Active, TokenizedRequest
from npu_proxy.workers.generation.engine_base import EngineBase, Request, TokenStreamer
from npu_proxy.workers.generation.prompting import Prompting

log = logging.getLogger(__name__)



class SerialEngine(EngineBase):
    """One request at a time through an LLMPipeline; the others wait in a bounded queue."""

    # NOTE: LLMPipeline's streamer gets token ids only, and its results a sum of log-probs per
    # sequence: a request for logprobs goes to another worker (ErrorCode.UNSUPPORTED).
    gives_logprobs = False

    def prompt_limit(self) -> tuple[int, bool]:
        return self.spec.max_prompt_len, True

    def room(self, prompt_tokens: int) -> int:
        # NOTE: the compiled KV cache holds MAX_PROMPT_LEN + MIN_RESPONSE_LEN tokens.
        return min(self.context_length,
                   self.spec.max_prompt_len + self.spec.min_response_len) - prompt_tokens

    def load(self, properties: dict[str, Any]) -> None:
        props = dict(properties)
        if self.spec.device.upper().startswith("NPU"):
            props["MAX_PROMPT_LEN"] = self.spec.max_prompt_len
            props["MIN_RESPONSE_LEN"] = self.spec.min_response_len
        self.pipe = ov_genai.LLMPipeline(self.model_path, self.spec.device, props)
        self.prompting = Prompting.of_model(self.model_path, self.pipe.get_tokenizer(),
                                            self.context_length, self.chat_template)
        self.base_config = self.pipe.get_generation_config()
        self.base_config.stop_token_ids = set(self.base_config.stop_token_ids) | self.prompting.ends

    def warm_up(self) -> None:
        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = 1
        self.pipe.generate("Hello", cfg)

    # --- receiver thread -----------------------------------------------------------------

    def submit(self, msg: Request) -> None:
        # NOTE: checked on arrival, not when its turn comes, so a prompt too long for the NPU
        # goes elsewhere at once.
        self._take(msg)
        self._dispatch(msg)

    # --- engine thread -------------------------------------------------------------------

    def _step(self) -> bool:
        taken = self._next()
        if taken is None:
            return False
        ready, active = taken
        if active is not None:
            self._generate(ready, active)
        return True

    def _generate(self, ready: TokenizedRequest, active: Active) -> None:
        req = ready.req
        try:
            self.pipe.generate(ov.Tensor(ready.ids), ready.config, TokenStreamer(self, active))
        except Exception as exc:
            log.exception("generation failed", extra={"request_id": req.log_id or req.id})
            self._active.pop(req.id, None)
            self._refuse(Failed(id=req.id, seq=active.seq, code=ErrorCode.INTERNAL,
                                message=f"generation failed: {exc}"))
            return
        if not active.cancelled and active.completion_tokens >= ready.config.max_new_tokens:
            active.finish_reason = "length"
        self._active.pop(req.id, None)
        self._finish(active)
