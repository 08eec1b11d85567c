"""The one typed configuration object, built once by the supervisor and handed to children.

Precedence: built-in defaults < TOML file < `NPU_PROXY_*` environment < command-line flags.
Children never read the environment: the supervisor writes the effective configuration as
JSON into the private runtime folder and passes its path.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import msgspec

Role = Literal["llm", "npu", "embed", "vlm", "rerank", "asr", "tts"]

DEFAULT_LLM_MODEL = "smollm2:135m"
DEFAULT_EMBED_MODEL = "all-minilm:l6-v2"
DEFAULT_RERANK_MODEL = "all-minilm-rerank:l6-v2"
# Seconds a lazy worker stays loaded after its last request: Ollama's default keep_alive.
DEFAULT_WORKER_KEEP_ALIVE = 300.0
DEFAULT_ASR_MODEL = "whisper:tiny.en"
DEFAULT_TTS_MODEL = "piper:en-us-joe-medium"


class ModelSource(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Where a model's files come from: a Hugging Face repository (its allow-listed files, or
    one `file` such as a GGUF, or a quantisation tag like `Q4_K_M` picking one GGUF), or a
    local file or folder (`path`), used in place and never copied."""

    repo: str = ""
    file: str = ""
    revision: str = "main"
    path: str = ""
    # "" = detected from the files (config.json architectures, GGUF general.architecture)
    # "vlm": a vision-language model (text generation that also takes images; role vlm).
    # "asr": a speech-recognition (Whisper) model, served by an asr worker.
    # "tts": a Piper (VITS) voice as ONNX with its .onnx.json, served by a tts worker.
    kind: Literal["llm", "vlm", "embed", "rerank", "asr", "tts", ""] = ""
    # INT4 symmetric, channel-wise weights: what the NPU plugin compiles (others may not).
    npu_ready: bool = False
    description: str = ""
    # A Jinja chat template used instead of the model's own (e.g. one that thinks).
    chat_template: str = ""


class FaultHooks(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Test-only fault injection; inert unless set explicitly for one worker."""

    hang_in_load: bool = False
    crash_in_load: bool = False
    exit_after_tokens: int | None = None
    abort_after_tokens: int | None = None
    stall_after_tokens: int | None = None
    # Stay loading until this file exists (a test can then observe the loading state).
    hold_load_until: str = ""
    # Skip one sequence number in each request's frames once it has this many tokens (what
    # a frame dropped by PUB looks like to the gateway).
    gap_after_tokens: int | None = None
    # Take no request (Generate) until this file exists: a client can give up before its
    # request is accepted.
    hold_accept_until: str = ""
    # Hold each request after the engine dequeued it (tracked as active) and before it starts
    # generating, until this file exists: an abort can then arrive in exactly that window.
    hold_start_until: str = ""
    # Constrain every generation that has no other constraint (JSON schema, regex) to this
    # regular expression: a test hook that makes a tiny model answer in a given shape (e.g.
    # `<think>…</think>answer`) through any API.
    force_regex: str = ""
    # Once this many tokens were generated, hold the GIL on the engine thread for
    # spin_seconds while spinning the CPU, once per process: what a long prefill inside one
    # pipeline step looks like from outside (silent heartbeats, but computing).
    spin_after_tokens: int | None = None
    spin_seconds: float = 0.0
    # Once this many tokens were generated, hold the GIL for good without using the CPU: a
    # deadlock inside a native call.
    freeze_after_tokens: int | None = None


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
    # Continuous batching (llm role).
    max_batch_tokens: int = 2048
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


def _default_workers() -> list[WorkerSpec]:
    return default_workers(["CPU"])


def default_workers(devices: list[str]) -> list[WorkerSpec]:
    """The npu role only where an NPU exists; the llm role on a GPU if any, else the CPU;
    embeddings and reranking on the CPU."""
    names = [d.upper() for d in devices]
    workers = []
    if any(d.startswith("NPU") for d in names):
        workers.append(WorkerSpec(name="npu", role="npu", device="NPU"))
    gpu = next((d for d in devices if d.upper().startswith("GPU")), None)
    workers.append(WorkerSpec(name="llm", role="llm", device=gpu or "CPU"))
    workers.append(WorkerSpec(name="embed", role="embed", device="CPU"))
    workers.append(WorkerSpec(name="rerank", role="rerank", device="CPU"))
    return workers


def _default_runtime_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return str(Path(base) / f"npu-proxy-{os.getuid()}")


class Config(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 11435
    runtime_dir: str = ""
    model_cache: str = "~/.cache/npu-proxy/models"
    # "ipc" (POSIX default) or "tcp" on 127.0.0.1 (the Windows path). On tcp every socket is
    # encrypted and authenticated with CURVE keys from `keys_dir` (protocol/keys.py).
    transport: Literal["ipc", "tcp"] = "ipc"
    # tcp: the control socket is this port, the supervisor's events the next one, then each
    # worker's `in` and `out` (2 + 2 * its index among this host's workers, and one more).
    tcp_base_port: int = 15600
    # tcp: the address this instance's worker sockets bind to (control and events always
    # stay on 127.0.0.1). A `--worker-only` host serving a gateway elsewhere sets its own
    # network address here.
    worker_host: str = "127.0.0.1"
    # tcp: the folder of this instance's CURVE key pairs (server.key[_secret],
    # client.key[_secret]); "" = <runtime_dir>/keys. Created (0700, files 0600) on start.
    keys_dir: str = ""
    # tcp: public client keys (other hosts' `client.key`) allowed to use this instance's
    # workers, besides its own: the gateways of other hosts joining a `--worker-only` host.
    client_key_files: list[str] = msgspec.field(default_factory=list)
    # Run the supervisor and workers without a gateway (workers for another host's gateway).
    worker_only: bool = False
    # Largest ZeroMQ message a gateway or supervisor socket receives from a worker (token
    # frames, embeddings of a whole request, heartbeats); a larger one drops the connection.
    # A worker takes requests up to 2 * max_body_bytes + 1 MiB (protocol/sockets.py).
    max_frame_bytes: int = 64 * 1024 * 1024
    inference_timeout: float = 180.0
    log_level: str = "INFO"
    log_format: Literal["text", "json"] = "text"
    # Each process's log file (<runtime>/logs/<name>.log) rotates past this size, keeping
    # log_backups older files (<name>.log.1 is the newest of them).
    log_max_bytes: int = 10 * 1024 * 1024
    log_backups: int = 3
    # --- who may talk to the HTTP port (gateway/http/policy.py, gateway/http/auth.py).
    # The key every route that does work or shows state wants (Bearer or x-api-key); "" =
    # none. A bind to anything but loopback needs one, or allow_unauthenticated_remote.
    api_key: str = ""
    # Serve a non-loopback address without a key: anyone who reaches the port can use it.
    allow_unauthenticated_remote: bool = False
    # Host header names accepted on a loopback bind besides loopback, private and link-local
    # IP literals, this machine's hostname and names under .localhost/.local/.internal
    # (a name, without port; "*" = any). Refusing the others stops DNS rebinding. A
    # non-loopback bind accepts any Host, as Ollama does (and needs a key).
    allowed_hosts: list[str] = msgspec.field(default_factory=list)
    # Browser origins (e.g. "https://chat.example.com", "http://*.example.lan:*", "*",
    # "null") whose pages may call the API besides Ollama's defaults, which always may:
    # http(s) pages of localhost, 127.0.0.1, [::1] and 0.0.0.0 on any port, app://,
    # file://, tauri://, vscode-webview://, vscode-file:// and browser extensions
    # (gateway/http/policy.py DEFAULT_ORIGINS). Every other page is refused (403), like
    # OLLAMA_ORIGINS. "*" admits every web origin but not "null" (sandboxed frames, files),
    # which is admitted only when listed.
    allowed_origins: list[str] = msgspec.field(default_factory=list)
    heartbeat_interval: float = 0.5
    grace_period: float = 10.0
    max_restarts: int = 5
    restart_window: float = 60.0
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    embedding_cache_size: int = 1000
    # Embedding batching (workers/embed_engine.py): requests queued together are embedded in
    # one pipeline call of at most embedding_max_batch texts; once requests arrive together
    # (bursts of concurrent clients), the worker waits for stragglers as long as each comes
    # within embedding_batch_wait seconds of the one before (0: never waits; a lone
    # client's requests never wait).
    embedding_max_batch: int = 64
    embedding_batch_wait: float = 0.015
    # --- limits: each is answered before anything reaches a worker, in the caller's API's
    # error shape (gateway/api/limits.py, gateway/api/request_path.py, gateway/api/embeddings.py).
    # A request body larger than this many bytes is refused with 413, whether it declares its
    # length (Content-Length) or not (chunked). NOTE: 32 MiB is what Anthropic's own Messages
    # API accepts, so every request Claude Code builds (long sessions, pasted screenshots as
    # base64) fits, as does a long RAG prompt; the gateway keeps at most this much of a body.
    max_body_bytes: int = 32 * 1024 * 1024
    # A blob uploaded for /api/create (POST /api/blobs/sha256:<hex>, a GGUF model file) larger
    # than this is refused with 413; blobs stream to disk, so max_body_bytes does not apply.
    # NOTE: 64 GiB takes a 70B model at 4-5 bits per weight; the disk is the other limit.
    max_blob_bytes: int = 64 * 1024 * 1024 * 1024
    # Messages of one chat (after translation: Anthropic's system and each tool_result count
    # as one), tools offered in one request, and the characters of all message texts and the
    # prompt (system included) before tokenizing; a request over one is a 400 naming it.
    # NOTE: 10,000 messages is far more than any context holds; 256 tools is twice OpenAI's
    # own limit (Claude Code with many MCP servers offers over 100); 1,000,000 characters is
    # more than the longest context served (128K tokens is at most ~512K characters of
    # English), yet keeps a multi-megabyte prompt away from the tokenizers.
    max_messages: int = 10_000
    max_tools: int = 256
    max_prompt_chars: int = 1_000_000
    # Embeddings: inputs in one request, and characters in one input (400 beyond either).
    max_embed_items: int = 512
    max_embed_chars: int = 100_000
    # Rerank: documents in one request, and characters in the query and in each document.
    max_rerank_documents: int = 1000
    max_rerank_chars: int = 100_000
    # Images in chats (gateway/content/images.py), each checked before anything reaches a worker:
    # its bytes once decoded, its pixels (width x height, read from the header) and the images
    # of one request. NOTE: 20 MiB is Anthropic's own per-image cap when sent through its API
    # (and its base64, 27 MiB, fits max_body_bytes); 40 megapixels takes any phone photo or
    # 4K/5K screenshot, stays under Pillow's decompression-bomb threshold (89 MP), and is what
    # a vlm worker decodes at most (workers/vlm_engine.py MAX_PIXELS: raising this one past it
    # only moves the refusal there); 16 images already fill the context of the small VLMs
    # served here.
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_images: int = 16
    # Fetch http(s) image URLs (OpenAI image_url, Responses input_image, Anthropic url
    # sources)? Off: such a URL is a 400 that says so, and only inline images (base64, data:
    # URLs) are taken. On, the gateway fetches them (within image_url_timeout seconds in all,
    # max_image_bytes, at most 5 redirects, only to http(s)); NOTE: it then reaches whatever
    # address a client names (SSRF): turn it on only where that is acceptable.
    image_urls: bool = False
    image_url_timeout: float = 10.0
    # A JSON schema for structured output or a tool's parameters (gateway/content/schema_check.py):
    # its subschemas, counted as they are met, and their nesting; a 400 beyond either.
    # NOTE: checking is linear in the schema's text; 20,000 subschemas is far more than any
    # real schema has (OpenAI's own limit is 5,000 properties, 10 levels), and 64 levels is
    # deeper than XGrammar's compiler is comfortable with anyway.
    max_schema_nodes: int = 20_000
    max_schema_depth: int = 64
    # Request bodies being received at once (gateway/http/body_gate.py), counted from the
    # first byte read to the last, after the Host, Origin and key checks; one more is 503
    # with Retry-After before its body is read. A body must keep arriving: a read waiting
    # longer than body_read_timeout seconds for its next chunk ends the request (408).
    # NOTE: 64 bodies of at most max_body_bytes pin at most 2 GiB; one that trickles in
    # holds a slot only body_read_timeout seconds per chunk.
    max_receiving_bodies: int = 64
    body_read_timeout: float = 30.0
    # A refused request's body (401, 403, 413, 503) is read and dropped, up to this many
    # bytes, so its client sees the answer; beyond that the connection is closed.
    max_drain_bytes: int = 64 * 1024 * 1024
    # Responses API (/v1/responses): responses kept for previous_response_id and
    # GET/DELETE /v1/responses/{id} (a request's `store`, true by default as in OpenAI), in the
    # gateway's memory only: at most this many, each for this many seconds, and at most this
    # many bytes of them all (their JSON); the oldest go first. 0 responses = none are kept.
    responses_store_max: int = 1000
    responses_store_ttl: float = 3600.0
    responses_store_max_bytes: int = 256 * 1024 * 1024
    # Speech (POST /v1/audio/transcriptions and /translations, gateway/content/audio.py): an
    # uploaded audio file's bytes (413 beyond) and its length in seconds once decoded (400
    # beyond). NOTE: 25 MiB is OpenAI's own upload limit; 600 s of speech takes Whisper tiny
    # about a minute on 2 CPU cores, well inside inference_timeout.
    max_audio_bytes: int = 25 * 1024 * 1024
    max_audio_seconds: float = 600.0
    # POST /v1/audio/speech: characters of `input` (400 beyond; OpenAI's own limit).
    max_speech_chars: int = 4096
    # --- model cache upkeep (issue 27; gateway/admin/manage.py, models/upkeep.py) ---
    # Bytes the model cache may hold (pulled models, blobs, staged pulls; not the compile
    # cache nor converted IR); a pull or a blob upload that would pass it is refused (400/413
    # naming this setting). 0 = no quota.
    max_cache_bytes: int = 0
    # Pulls run at once, on their own threads (never the default executor that image
    # decoding, model switches and create/copy/delete use); more wait for a free one.
    pull_threads: int = 2
    # An interpreter with optimum-intel and torch (the `convert` extra) that builds the
    # embedded Whisper model once into the model cache (workers/speech/whisper_ir.py);
    # "" = the server's own, which then needs that extra.
    converter_python: str = ""
    # Live status pages open at once (each holds one GET /status/events stream); more are
    # answered 503 with Retry-After.
    status_max_streams: int = 32
    model_aliases: dict[str, str] = msgspec.field(default_factory=dict)
    # The model every `claude-*` name (what Claude Code asks for) stands for, unless
    # model_aliases names it exactly; "" = the default LLM (first enabled llm/npu worker's).
    claude_model: str = ""
    workers: list[WorkerSpec] = msgspec.field(default_factory=_default_workers)
    # OpenVINO devices found at start (name -> full name), filled in by the supervisor.
    devices: dict[str, str] = msgspec.field(default_factory=dict)
    # The user's own registry entries: `[models."name:tag"]` with repo (+ file) or path.
    models: dict[str, ModelSource] = msgspec.field(default_factory=dict)
    # Seconds a request waits for a worker to switch to the model it names.
    switch_timeout: float = 300.0

    def __post_init__(self) -> None:
        # NOTE: whether a generation worker is lazy depends on the other workers (is its
        # model the default one?), so it is settled here, once, for every process alike.
        generators = [w for w in self.workers if w.enabled and w.role in ("llm", "npu")] or \
            [w for w in self.workers if w.enabled and w.role == "vlm"]
        default = generators[0].model_name if generators else ""
        for spec in self.workers:
            if self.worker_only:
                spec.lazy = False
            elif spec.lazy is None:
                spec.lazy = spec.model_name != default

    def remote_bind_refusal(self) -> str | None:
        """Why this configuration must not start (a remote bind without a key), or None."""
        if is_loopback_host(self.host) or self.api_key or self.allow_unauthenticated_remote:
            return None
        return (f"refusing to listen on {self.host or 'every address'} without an API key: "
                "anyone who can reach the port could use it. Set api_key (NPU_PROXY_API_KEY), "
                "or bind to 127.0.0.1 (--host 127.0.0.1), or accept the risk with "
                "allow_unauthenticated_remote = true (NPU_PROXY_ALLOW_UNAUTHENTICATED_REMOTE=1 "
                "or --allow-unauthenticated-remote)")

    def runtime_path(self) -> Path:
        return Path(self.runtime_dir or _default_runtime_dir())

    def keys_path(self) -> Path:
        return Path(self.keys_dir).expanduser() if self.keys_dir else \
            self.runtime_path() / "keys"

    def local_workers(self) -> list[WorkerSpec]:
        """The workers this instance runs (not those served by another host)."""
        return [spec for spec in self.workers if not spec.address]

    def model_cache_path(self) -> Path:
        return Path(self.model_cache).expanduser()

    def worker(self, name: str) -> WorkerSpec:
        for spec in self.workers:
            if spec.name == name:
                return spec
        raise KeyError(name)


def is_loopback_host(host: str) -> bool:
    """`localhost` or a loopback address: reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # NOTE: another name may resolve to anything; treated as remote


REDACTED = "<redacted>"


def redacted(config: Config) -> Config:
    """The configuration as it may be shown or logged: the API key replaced."""
    return msgspec.structs.replace(config, api_key=REDACTED) if config.api_key else config


def _flag(value: str) -> bool:
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false")


def _names(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


# Environment variable -> (config field, parser). The npu-proxy specification's names, and
# NPU_PROXY_ORIGINS as Ollama's OLLAMA_ORIGINS (comma-separated).
_ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "NPU_PROXY_HOST": ("host", str),
    "NPU_PROXY_PORT": ("port", int),
    "NPU_PROXY_RUNTIME_DIR": ("runtime_dir", str),
    "NPU_PROXY_MODEL_PATH": ("model_cache", str),
    "NPU_PROXY_TRANSPORT": ("transport", str),
    "NPU_PROXY_INFERENCE_TIMEOUT": ("inference_timeout", float),
    "NPU_PROXY_LOG_LEVEL": ("log_level", str),
    "NPU_PROXY_LOG_FORMAT": ("log_format", str),
    "NPU_PROXY_API_KEY": ("api_key", str),
    "NPU_PROXY_ALLOW_UNAUTHENTICATED_REMOTE": ("allow_unauthenticated_remote", _flag),
    "NPU_PROXY_ALLOWED_HOSTS": ("allowed_hosts", _names),
    "NPU_PROXY_ORIGINS": ("allowed_origins", _names),
    "NPU_PROXY_CLAUDE_MODEL": ("claude_model", str),
    "NPU_PROXY_EMBEDDING_CACHE_SIZE": ("embedding_cache_size", int),
    "NPU_PROXY_EMBEDDING_MAX_BATCH": ("embedding_max_batch", int),
    "NPU_PROXY_EMBEDDING_BATCH_WAIT": ("embedding_batch_wait", float),
    "NPU_PROXY_IMAGE_URLS": ("image_urls", _flag),
}


class ConfigError(Exception):
    pass


def load_config(
    path: Path | None = None,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
    devices: dict[str, str] | None = None,
) -> Config:
    """Build the effective configuration from file, environment and explicit overrides.

    `devices` (discovered name -> full name) picks the default workers when the
    configuration names none, and is recorded for /health/devices.
    """
    env = dict(os.environ) if env is None else env
    data: dict[str, Any] = {}
    if path is None and env.get("NPU_PROXY_CONFIG"):
        path = Path(env["NPU_PROXY_CONFIG"])
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    for var, (field, kind) in _ENV.items():
        if var in env:
            try:
                data[field] = kind(env[var])
            except ValueError as exc:
                raise ConfigError(f"{var}={env[var]!r}: {exc}") from exc
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    if devices is not None:
        data["devices"] = devices
        if "workers" not in data:
            data["workers"] = msgspec.to_builtins(default_workers(list(devices)))
    try:
        return msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc


def dump_config(config: Config) -> bytes:
    return msgspec.json.encode(config)


def read_config_file(path: Path) -> Config:
    """Read the JSON configuration the supervisor wrote for its children."""
    return msgspec.json.decode(path.read_bytes(), type=Config)
