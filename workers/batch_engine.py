"""The continuous-batching engine (role `llm`, GPU/CPU): many requests at once.

It runs a ContinuousBatchingPipeline with prefix caching on. Its generate() refuses concurrent
callers, so the engine thread loops `step()` while requests arrive through `add_request()` and
their handles are read for new tokens after every step.

Admission: at most max_running requests are in the pipeline (the scheduler's max_num_seqs is
set to the same number); accepted ones beyond that wait in the engine's queue (max_queue), and
the worker refuses more with QUEUE_FULL (workers/process.py), so many concurrent streams cost
a bounded amount of memory and the ones admitted finish instead of all timing out together.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openvino as ov
import openvino_genai as ov_genai

from npu_proxy.protocol.config import WorkerSpec
from npu_proxy.protocol.messages import ErrorCode, Failed, SamplingParams
from npu_proxy.workers.engine import Emit
from npu_proxy.workers.generation.active import TokenizedRequest
from npu_proxy.workers.generation.engine_base import EngineBase
from npu_proxy.workers.generation.prompting import Prompting
from npu_proxy.workers.generation.sampling import generation_config
from npu_proxy.workers.generation.weights import read_back_by_page, release_after_warm_up

log = logging.getLogger(__name__)

# The warm-up's prompt length: past the row count at which the CPU plugin changes kernels.
WARM_UP_TOKENS = 32

_DONE = (
    ov_genai.GenerationStatus.FINISHED,
    ov_genai.GenerationStatus.CANCEL,
    ov_genai.GenerationStatus.STOP,
    ov_genai.GenerationStatus.IGNORED,
)


def _model_generation_config(model_path: str, pipe: Any) -> Any:
    """The model's own generation defaults: its generation_config.json, else the tokenizer's
    end-of-sequence token."""
    saved = Path(model_path) / "generation_config.json"
    cfg = ov_genai.GenerationConfig(str(saved)) if saved.is_file() else ov_genai.GenerationConfig()
    if cfg.eos_token_id < 0:
        cfg.eos_token_id = pipe.get_tokenizer().get_eos_token_id()
    cfg.stop_token_ids = {t for t in cfg.stop_token_ids if t >= 0} | {cfg.eos_token_id}
    return cfg


# The llm role's OpenVINO properties per device, under the worker's own `properties` (which
# win): the fastest decode measured by bench/levers.py and bench/batch_step.py, with its
# accuracy cost measured by bench/precision.py (docs/performance.md, "Single-stream decode").
# NOTE: CPU: the precision that wins depends on the CPU. With AMX (Intel Xeon 4th gen and
# later), f32 inference, which turns on OpenVINO's dynamic quantization of activations to 8
# bits in groups of 32 for the compressed-weight products (llama.cpp does the same for a Q4_1
# GGUF: Q8_1 activations), decoded x1.4-1.5 faster than OpenVINO's bf16 default (SmolLM2 and
# Qwen2.5-Coder-1.5B). Without AMX but with AVX512-BF16 (AMD Zen 4), OpenVINO's bf16 default
# won: Qwen decode x1.0-1.17 alone, x1.37 at 8 streams, x1.34 at 32, a 1,000-token prompt read
# x1.23 faster; SmolLM2 x1.0-1.06. Without either, OpenVINO's default is f32 on the x86 CPUs
# measured. So f32 is asked for only where AMX is usable. `INFERENCE_PRECISION_HINT` in a
# worker's properties overrides it; adding `DYNAMIC_QUANTIZATION_GROUP_SIZE = 0` to f32 gives
# the most exact.
# GPU: not measured here.
def _cpu_defaults() -> dict[str, Any]:
    return {"INFERENCE_PRECISION_HINT": "f32"} if amx_usable() else {}


def amx_usable(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether OpenVINO's CPU kernels may use AMX here: the CPU has it (Linux's flags; False
    where they cannot be read) and ONEDNN_MAX_CPU_ISA, when set, does not hold oneDNN below
    it (the narrow-ISA tests set it)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if cap not in ("", "ALL", "DEFAULT") and "AMX" not in cap:
        return False
    try:
        with cpuinfo.open(encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "amx_int8" in flags.split()


def _cpu_precision() -> str:
    """The CPU plugin's default inference precision ("bf16", "f32"), for the log (never fails
    a load)."""
    try:
        value = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT")
    except RuntimeError:
        return "not known"
    return str(value.get_type_name()) if isinstance(value, ov.Type) else str(value)


DEVICE_DEFAULTS: dict[str, Callable[[], dict[str, Any]]] = {"CPU": _cpu_defaults}
# A worker that decodes speculatively (prompt lookup, a draft model) verifies several tokens
# in one pass, and its greedy text must be the text one-token steps would make. Dynamic
# quantization gives a pass of several tokens other numbers than one-token steps (measured:
# bench/lookup.py's code edit, 0 of 5 identical), so such a worker does without it on CPU.
SPECULATIVE_DEFAULTS: dict[str, Callable[[], dict[str, Any]]] = {
    "CPU": lambda: {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0},
}


def default_properties(device: str, speculative: bool = False) -> dict[str, Any]:
    table = SPECULATIVE_DEFAULTS if speculative else DEVICE_DEFAULTS
    defaults = table.get(device.split(".")[0].upper())
    return defaults() if defaults is not None else {}


def without_useless_cache(device: str, properties: dict[str, Any]) -> dict[str, Any]:
    """The properties without CACHE_DIR on the CPU, where it costs and never pays.

    NOTE: the CPU plugin (OpenVINO 2026.4) cannot import the blob of a model with
    PagedAttention, which every ContinuousBatchingPipeline compiles: the nodes' runtime info
    (k_head_size, num_k_heads) is not in the blob, so every start compiled again and wrote a
    new 133 MB blob over the old one (SmolLM2: 0.6 s more CPU per start, bench/start.py).
    GPU keeps its cache (kernels)."""
    if device.split(".")[0].upper() != "CPU" or "CACHE_DIR" not in properties:
        return properties
    return {k: v for k, v in properties.items() if k != "CACHE_DIR"}


def prefix_cached(spec: WorkerSpec) -> bool:
    """Does the worker reuse the KV cache of a prompt's start computed before?"""
    return spec.prefix_caching and not spec.deterministic


def scheduler_config(spec: WorkerSpec, context_length: int) -> Any:
    """The worker's continuous-batching scheduler: prefix caching on, prompts read in steps;
    deterministic: one sequence per step (spec.max_running is 1), no prefix caching."""
    sched = ov_genai.SchedulerConfig()
    # NOTE: a prefix-cache hit computes only the prompt's uncached tail, in other shapes than
    # the whole prompt; deterministic mode makes every request compute its whole prompt.
    sched.enable_prefix_caching = prefix_cached(spec)
    sched.cache_size = max(1, int(spec.kv_cache_gb))
    # NOTE: a prompt is read in steps of spec.max_batch_tokens (512 by default; 0 = a whole
    # prompt per step). The plugin keeps its largest step's scratch for reuse, so the step
    # bounds what a long prompt leaves resident (Qwen2.5-Coder-1.5B after a 1,000-token
    # prompt: -100 MiB against one step), and step() holds the GIL, so heartbeats (which say
    # `blocking` meanwhile: BatchEngine.blocking), other streams' tokens and aborts wait at
    # most a step. Measured in fresh processes (docs/performance.md): same greedy ids; TTFT
    # x1.01 for SmolLM2 at 7,900 tokens, x1.09 for Qwen at 1,000 and x1.07 at 4,000.
    sched.max_num_batched_tokens = spec.max_batch_tokens or context_length
    sched.max_num_seqs = spec.max_running
    return sched


class BatchEngine(EngineBase):
    """Continuous batching on GPU or CPU: many requests at once, prefix caching on."""

    def __init__(self, spec: WorkerSpec, model_path: str, context_length: int, emit: Emit) -> None:
        super().__init__(spec, model_path, context_length, emit)
        # NOTE: a prefix-cache hit returns no log-probabilities for the cached start of an
        # echoed prompt (measured: only the positions computed come back).
        self.gives_prompt_logprobs = not prefix_cached(spec)
        self._next_handle_id = 0
        # A request has run since the warm-up, and what it read in place is not yet set to
        # come back by page (generation/weights.py read_back_by_page): done once, when idle.
        self._read_by_page_due = False
        # The draft model's files when the worker decodes speculatively (spec.draft_model).
        self.draft_path = ""

    def load(self, properties: dict[str, Any]) -> None:
        sched = scheduler_config(self.spec, self.context_length)
        speculative = bool(self.spec.prompt_lookup or self.draft_path)
        properties = without_useless_cache(
            self.spec.device, {**default_properties(self.spec.device, speculative), **properties})
        # NOTE: what the pipeline really gets (the worker logged its own properties only).
        log.info("OpenVINO properties in effect: %s", properties)
        if self.spec.device.upper().startswith("CPU") and (
                "INFERENCE_PRECISION_HINT" not in properties):
            log.info("inference precision: %s, OpenVINO's default on this CPU (f32 is the "
                     "default only where AMX is usable)", _cpu_precision())
        if self.spec.deterministic:
            log.info("deterministic: one sequence per step, no prefix caching")
        if self.spec.prompt_lookup:
            properties = {**properties, "prompt_lookup": True}
        if self.draft_path:
            properties = {**properties, "draft_model": self._draft(properties)}
        self.pipe = ov_genai.ContinuousBatchingPipeline(
            self.model_path, sched, self.spec.device, properties
        )
        self.prompting = Prompting.of_model(self.model_path, self.pipe.get_tokenizer(),
                                            self.context_length, self.chat_template)
        self.base_config = self.pipe.get_config()
        if self.base_config.eos_token_id < 0:
            # NOTE: a prompt-lookup pipeline reports a blank config (no EOS, no stop ids).
            self.base_config = _model_generation_config(self.model_path, self.pipe)
        self.base_config.stop_token_ids = set(self.base_config.stop_token_ids) | self.prompting.ends
        if self.spec.prompt_lookup:
            self.base_config.num_assistant_tokens = self.spec.prompt_lookup
            self.base_config.max_ngram_size = self.spec.prompt_lookup_ngram
            log.info("prompt lookup on: up to %d tokens per step from %d-grams of the prompt",
                     self.spec.prompt_lookup, self.spec.prompt_lookup_ngram)
        if self.draft_path:
            if self.spec.draft_confidence > 0:
                self.base_config.assistant_confidence_threshold = self.spec.draft_confidence
            else:
                self.base_config.num_assistant_tokens = self.spec.draft_tokens
            log.info("speculative decoding on: draft %s on %s, %s", self.spec.draft_model,
                     self.spec.draft_device or self.spec.device,
                     f"tokens while at least {self.spec.draft_confidence} sure"
                     if self.spec.draft_confidence > 0
                     else f"{self.spec.draft_tokens} tokens per step")

    def _draft(self, properties: dict[str, Any]) -> Any:
        """The draft model for the pipeline's properties: its own device and the worker's
        compile properties (cache folder, precision hints) when on the same device."""
        device = self.spec.draft_device or self.spec.device
        same = {k: v for k, v in properties.items() if k not in ("prompt_lookup",)}
        props = same if device == self.spec.device else {}
        return ov_genai.draft_model(self.draft_path, device, **props)

    def warm_up(self) -> None:
        """A short generation, so the first real request does not pay for compilation; then
        the weight files' pages, which the plugin has copied by now, the code that compiling
        ran and the heap it freed are let go (generation/weights.py).

        NOTE: a prompt of WARM_UP_TOKENS, then one decoded token: the CPU plugin repacks
        each matrix product's weights for a kernel chosen by the rows of the step (here one
        for up to ~5 rows, another from ~8), reading them from the mapped file the first
        time a step of that size runs. Warmed up on a one-token prompt, the first prompt of
        8 tokens or more (any chat) read all of SmolLM2's layer weights back in, 52 MiB
        resident for good after the release."""
        assert self.prompting is not None
        cfg = generation_config(SamplingParams(max_tokens=2, temperature=0.0),
                                self.base_config, 2)
        cfg.ignore_eos = True  # NOTE: the second token is the decode step's warm-up.
        length = max(1, min(WARM_UP_TOKENS, self.context_length - 2))
        ids = self.prompting.encode(" ".join(["Hello"] * WARM_UP_TOKENS))[:, :length]
        handle = self.pipe.add_request(self._handle_id(), ov.Tensor(ids), cfg)
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
        handle.read_all()
        release_after_warm_up(self.model_path, self.draft_path)

    def _step(self) -> bool:
        self._drain_inbox()
        self._start_waiting()
        if not self._active:
            if self._read_by_page_due:
                self._read_by_page_due = False
                read_back_by_page(self.model_path, self.draft_path)
            return False
        self.pipe.step()
        self._collect()
        return True

    def _handle_id(self) -> int:
        self._next_handle_id += 1
        return self._next_handle_id

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._dispatch(msg)

    @property
    def blocking(self) -> bool:
        # NOTE: the engine thread steps the pipeline exactly while requests are in it.
        return bool(self._active)

    def _start_waiting(self) -> None:
        """Move waiting requests into the pipeline while fewer than max_running run."""
        idle = not self._active
        self._fill()
        if idle and self._active:
            # NOTE: the last heartbeat before the first (maybe long) step must say that the
            # worker is blocking, or its silence would count as a lost heartbeat.
            self.announce()

    def _fill(self) -> None:
        while len(self._active) < self.spec.max_running:
            taken = self._next()
            if taken is None:
                return
            ready, active = taken
            if active is None:
                continue
            try:
                active.handle = self._add_request(ready)
            except Exception as exc:
                self._active.pop(ready.req.id, None)
                # NOTE: seq 1: the request was accepted (seq 0) when it was queued.
                self._refuse(Failed(id=ready.req.id, seq=1, code=ErrorCode.BAD_REQUEST,
                                    message=str(exc)))
                continue
            if active.cancelled:  # NOTE: abort_all (drain thread) came before the handle
                active.handle.cancel()

    def _add_request(self, ready: TokenizedRequest) -> Any:
        """Put one request into the pipeline; its GenerationHandle."""
        handle = self.pipe.add_request(self._handle_id(), ov.Tensor(ready.ids), ready.config)
        # NOTE: handle 1 is the warm-up's, whose reads the release after it dropped.
        self._read_by_page_due = self._read_by_page_due or self._next_handle_id == 2
        return handle

    def _collect(self) -> None:
        now = time.time()
        done: list[str] = []
        for rid, active in self._active.items():
            handle = active.handle
            status = handle.get_status()
            if handle.can_read():
                for out in handle.read().values():
                    ids = list(out.generated_ids)
                    # NOTE: read only when asked; the pipeline computes them anyway.
                    logprobs = (list(out.generated_log_probs)
                                if active.logprobs is not None or active.echo else None)
                    if active.echo and ids:
                        ids, logprobs = self._on_prompt(active, ids, logprobs or [])
                    if ids:
                        self._on_tokens(active, ids, now, logprobs)
                    if out.finish_reason == ov_genai.GenerationFinishReason.LENGTH:
                        active.finish_reason = "length"
            if status in _DONE:
                done.append(rid)
            else:
                active.cancel_if_late(now)
            self._flush(active)
        for rid in done:
            self._finish(self._active.pop(rid))
