"""One `[[workers]]` section: a worker process, its role, device, model and limits."""

from __future__ import annotations

import functools
from typing import Literal

import msgspec

from npu_proxy.protocol.config.faults import FaultHooks
from npu_proxy.protocol.config.models import (
    ASR_PACKAGE,
    DEFAULT_ASR_MODEL,
    DEFAULT_EMBED_MODEL,
    DEFAULT_LLM_MODEL,
    DEFAULT_RERANK_MODEL,
    DEFAULT_TTS_MODEL,
    TTS_PACKAGE,
)

Role = Literal["llm", "npu", "embed", "vlm", "rerank", "asr", "tts"]

# Seconds a lazy worker stays loaded after its last request: Ollama's default keep_alive.
DEFAULT_WORKER_KEEP_ALIVE = 300.0


class WorkerSpec(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    name: str
    role: Role = "llm"
    device: str = "CPU"
    model: str = ""
    enabled: bool = True
    # Start on the first request that needs this worker instead of at start-up? None = the
    # role's default: lazy for embed and rerank, and for an llm/npu/vlm worker whose model
    # is not the default one (the first llm or npu worker's, else the first vlm worker's);
    # never for a worker served by another host or on a --worker-only host (no gateway
    # there to start it). Until then the worker is `idle` (not loaded): no process.
    lazy: bool | None = None
    # Seconds this worker stays loaded after its last request before it is stopped (back
    # to `idle`, not loaded; the next request that needs it starts it again); -1 = always
    # resident. None = DEFAULT_WORKER_KEEP_ALIVE (5 minutes, Ollama's) for a lazy worker,
    # -1 otherwise.
    keep_alive: float | None = None
    # Seconds a worker may stay loading/warming before it is killed (NPU compiles are slow).
    # 0 = the role's default: 1800 s for npu, 600 s otherwise.
    load_timeout: float = 0.0
    # Seconds without a heartbeat (while serving) before the worker is declared lost.
    heartbeat_timeout: float = 10.0
    # Seconds a busy worker may go without any progress (a token, a finished step) before it
    # is killed and restarted; 0 = the role's default: 300 s for npu, 120 s otherwise.
    stall_timeout: float = 0.0
    # Resident memory (MiB) past which the supervisor kills the worker (supervisor/memory.py);
    # 0 = the role's share of the machine: 60 % for llm, npu and vlm, 25 % otherwise; -1 = none.
    memory_limit_mb: int = 0
    # Admission: a worker takes at most max_running + max_queue requests (generations and
    # token counts); beyond that it answers QUEUE_FULL at once and the gateway tries the next
    # worker, else answers 503 with Retry-After.
    # Requests generating at once: always 1 for npu and for vlm on an NPU (one at a time); for
    # llm and vlm, 0 = 256 (the OpenVINO scheduler's max_num_seqs default); unused by embed
    # (batches of 64 texts).
    max_running: int = 0
    # Requests waiting beyond those running; 0 = the role's default: 4 for npu, 64 otherwise.
    max_queue: int = 0
    # Crashes within the restart window before the worker is left failed; 0 = the global one.
    max_restarts: int = 0
    # Stateful (npu) role limits, in tokens.
    max_prompt_len: int = 1024
    min_response_len: int = 128
    # Continuous batching (llm role): the most tokens one pipeline step computes; 0 = the
    # model's context (a whole prompt in one step). A prompt longer than N is computed in
    # steps of N: the CPU plugin keeps a step's intermediate buffers for reuse, so N bounds
    # what a long prompt leaves resident (Qwen2.5-Coder-1.5B, a 1,000-token prompt: about
    # 170 MiB in one step, 100 less in steps of 512; docs/performance.md, "Memory of the llm
    # worker"), and other streams decode between the steps. 512 is llama.cpp's own physical
    # batch (n_ubatch).
    max_batch_tokens: int = 512
    # Tokens per second: a generation's deadline (inference_timeout from its arrival) is
    # moved by the time its prompt takes to read at this rate, so a long prompt's prefill
    # (an agent's 12k-token first turn: 8 minutes on 2 CPU cores) is not cut by a deadline
    # meant for the generation; Ollama and llama-server set no deadline at all. The slowest
    # reading that still counts as working; 0 = the prompt counts against inference_timeout.
    min_prefill_rate: float = 5.0
    # The KV cache's limit (whole GB): the pipeline allocates blocks as requests need them.
    kv_cache_gb: float = 1.0
    # Prompt-lookup decoding (llm role): up to this many tokens per step are proposed from
    # n-grams of the prompt (of at most prompt_lookup_ngram tokens) and verified in one pass;
    # 0 = off. Output is unchanged; tasks that repeat their input (rewrite, edit code,
    # extract) decode faster. See bench/lookup.py.
    prompt_lookup: int = 0
    prompt_lookup_ngram: int = 3
    # Draft-model speculative decoding (llm role): a small model of the same tokenizer (a
    # model name, as `model` takes) proposes draft_tokens tokens per step, or as many as it
    # is at least draft_confidence sure of when that is > 0, and this worker's model
    # verifies them in one pass; "" = off. Greedy output is unchanged; a real speedup needs
    # a main model much larger than the draft (e.g. a 1.7B with the 135M as draft).
    draft_model: str = ""
    # The draft's device; "" = the worker's.
    draft_device: str = ""
    draft_tokens: int = 5
    draft_confidence: float = 0.0
    # Batch-invariant greedy decoding (llm and vlm roles): a temperature-0 request gets the
    # text it gets alone whatever else the worker runs, at the price of running one request
    # at a time (docs/configuration.md "Deterministic mode"). The npu role always is.
    deterministic: bool = False
    # Reuse the KV cache of a prompt's start that an earlier request computed (llm role; off
    # in deterministic mode). Off, every request reads its whole prompt, and the worker gives
    # prompt log-probabilities (echo with logprobs, prompt_logprobs), which a reused start
    # has none of: GenAI computes no logits for the cached positions.
    prefix_caching: bool = True
    # Beam search width of an asr worker's Whisper decoding; 1 = greedy. 5 as faster-whisper's
    # default: on bench/asr_wer.py's recordings, word error rate 31.1 % against greedy's
    # 33.4 %, at twice the decoding time. A request with a temperature above 0 samples.
    num_beams: int = 5
    # OpenVINO properties for this worker's pipeline (OVMS calls them plugin_config), e.g.
    # GENERATE_HINT = "BEST_PERF" on NPU or INFERENCE_NUM_THREADS = 2 on CPU; a name the
    # device does not know makes the load fail with OpenVINO's message.
    properties: dict[str, str | int | float | bool] = {}
    faults: FaultHooks = msgspec.field(default_factory=FaultHooks)
    # May a request for another (pulled) model reload this worker with it? None = the role's
    # default: off for npu (a cold NPU compile takes minutes), on otherwise.
    allow_switch: bool | None = None
    # Set by the supervisor while the worker serves a switched-to model: the configured model
    # it returns to when that one is unloaded (keep_alive). Not a setting.
    switched_from: str = ""
    # A worker on another host, run by that host's `npx-supervisor start --worker-only`:
    # "host:port" of its `in` socket there (its `out` socket is the next port). This instance
    # spawns nothing for it; its gateway connects to it over CURVE tcp, authenticating the
    # other host by `public_key_file`: a copy of that host's `server.key` (public).
    address: str = ""
    public_key_file: str = ""

    def __post_init__(self) -> None:
        if self.address:
            # NOTE: the supervisor that could reload it runs on the other host.
            self.allow_switch = False
            self.lazy = False
        if self.lazy is None and self.role in ("embed", "rerank", "asr", "tts"):
            self.lazy = True
        if self.keep_alive is not None and self.keep_alive < 0:
            self.keep_alive = -1.0
        if self.allow_switch is None:
            self.allow_switch = self.role != "npu"
        if self.load_timeout <= 0:
            self.load_timeout = 1800.0 if self.role == "npu" else 600.0
        if self.stall_timeout <= 0:
            self.stall_timeout = 300.0 if self.role == "npu" else 120.0
        if self.max_queue <= 0:
            self.max_queue = 4 if self.role == "npu" else 64
        if self.max_batch_tokens < 0:
            raise ValueError(f"worker {self.name}: max_batch_tokens must be >= 0 (0 = the "
                             "model's context)")
        if self.min_prefill_rate < 0:
            raise ValueError(f"worker {self.name}: min_prefill_rate must be >= 0 (0 = off)")
        if not 1 <= self.num_beams <= 16:
            raise ValueError(f"worker {self.name}: num_beams must be 1 to 16")
        if self.prompt_lookup < 0 or self.prompt_lookup_ngram < 1:
            raise ValueError("prompt_lookup must be >= 0 and prompt_lookup_ngram >= 1")
        if self.prompt_lookup and self.role != "llm":
            raise ValueError(f"worker {self.name}: prompt_lookup needs the llm role")
        if self.draft_model:
            if self.role != "llm":
                raise ValueError(f"worker {self.name}: draft_model needs the llm role")
            if self.prompt_lookup:
                raise ValueError(f"worker {self.name}: draft_model and prompt_lookup exclude "
                                 "each other")
            if self.draft_tokens < 1 or not 0.0 <= self.draft_confidence < 1.0:
                raise ValueError(f"worker {self.name}: draft_tokens must be >= 1 and "
                                 "draft_confidence in [0, 1)")
        if self.deterministic and self.role in ("llm", "vlm"):
            if self.prompt_lookup or self.draft_model:
                # NOTE: not measured: a speculative pass verifies several tokens at once.
                raise ValueError(f"worker {self.name}: deterministic excludes prompt_lookup "
                                 "and draft_model")
            # NOTE: one sequence per pipeline step: the only batch-invariant schedule
            # measured on CPU (docs/configuration.md "Deterministic mode").
            self.max_running = 1
        if self.role == "npu" or (self.role == "vlm" and self.device.upper().startswith("NPU")):
            self.max_running = 1
        elif self.max_running <= 0:
            self.max_running = 256

    @property
    def idle_stop(self) -> float | None:
        """Seconds idle after which the worker is stopped (not loaded); None = never."""
        keep = self.keep_alive
        if keep is None:
            keep = DEFAULT_WORKER_KEEP_ALIVE if self.lazy else -1.0
        return None if keep < 0 or self.address else keep

    @property
    def model_name(self) -> str:
        if self.model:
            return self.model
        if self.role == "rerank":
            return DEFAULT_RERANK_MODEL
        if self.role == "asr":
            return DEFAULT_ASR_MODEL
        if self.role == "tts":
            return DEFAULT_TTS_MODEL
        return DEFAULT_EMBED_MODEL if self.role == "embed" else DEFAULT_LLM_MODEL


@functools.cache
def _installed(distribution: str) -> bool:
    """Whether `distribution`'s package is importable; its import name is its name with
    underscores (true of the embedded models' packages, ASR_PACKAGE and TTS_PACKAGE).

    NOTE: not importlib.metadata: importing it (with email) and scanning every installed
    distribution cost 0.02-0.03 s of CPU of a start that lists no workers, before the
    supervisor spawns the gateway (tests/test_layers.py). find_spec imports nothing."""
    import importlib.util

    try:
        return importlib.util.find_spec(distribution.replace("-", "_")) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def _has_espeak() -> bool:
    """espeak-ng's library (Debian package espeak-ng), which the tts role phonemizes with."""
    import ctypes.util

    return ctypes.util.find_library("espeak-ng") is not None


SPEECH_NEEDS = ("text to speech (tts-1) needs espeak-ng's library (the Debian and Fedora "
                "package espeak-ng; macOS: brew install espeak-ng): install it and restart")


def speech_missing() -> str | None:
    """Why the embedded voice is not served though its package is installed (espeak-ng is
    missing), for the start-up log, doctor and the error a request gets; else None."""
    return SPEECH_NEEDS if _installed(TTS_PACKAGE) and not _has_espeak() else None


def default_workers(devices: list[str], asr: bool | None = None,
                    tts: bool | None = None) -> list[WorkerSpec]:
    """The npu role only where an NPU exists; the llm role on a GPU if any, else the CPU;
    embeddings, reranking, with `asr` speech recognition and with `tts` speech on the CPU
    (None: asr when the package that carries the embedded Whisper is installed, tts when
    the embedded Piper voice's package and espeak-ng's library both are). All but the llm
    and npu roles are lazy: no process until a request needs one; the Whisper IR is built
    by the asr worker's first load."""
    names = [d.upper() for d in devices]
    workers = []
    if any(d.startswith("NPU") for d in names):
        workers.append(WorkerSpec(name="npu", role="npu", device="NPU"))
    gpu = next((d for d in devices if d.upper().startswith("GPU")), None)
    workers.append(WorkerSpec(name="llm", role="llm", device=gpu or "CPU"))
    workers.append(WorkerSpec(name="embed", role="embed", device="CPU"))
    workers.append(WorkerSpec(name="rerank", role="rerank", device="CPU"))
    if _installed(ASR_PACKAGE) if asr is None else asr:
        workers.append(WorkerSpec(name="asr", role="asr", device="CPU"))
    if (_installed(TTS_PACKAGE) and _has_espeak()) if tts is None else tts:
        workers.append(WorkerSpec(name="tts", role="tts", device="CPU"))
    return workers
