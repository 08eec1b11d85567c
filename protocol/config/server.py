"""Where the server runs and how its processes talk, log, restart, and who may reach it."""

from __future__ import annotations

import ipaddress
from typing import Literal

import msgspec


class ServerSettings(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """The address, runtime folder, transport, logging, access and supervision settings."""

    host: str = "127.0.0.1"
    port: int = 11435
    runtime_dir: str = ""
    model_cache: str = "~/.cache/npu-proxy/models"
    # Bytes the model cache may hold (pulled models, blobs, staged pulls; not the compile
    # cache nor converted IR); a pull or a blob upload that would pass it is refused (400/413
    # naming this setting). 0 = no quota. (gateway/admin/manage.py, models/upkeep.py)
    max_cache_bytes: int = 0
    # Pulls run at once, on their own threads (never the default executor that image
    # decoding, model switches and create/copy/delete use); more wait for a free one.
    pull_threads: int = 2
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
    # A request in flight when its worker crashed (not an operator's restart) is refused with
    # a 400 for this long if sent again, so retries cannot crash the worker in a loop
    # (gateway/core/broker.py). 0 = never.
    crash_quarantine_seconds: float = 300.0
    # A generation in flight when its worker died (crashed, was killed as hung, restarted by
    # an operator) resumes on the worker once it serves again, from its prompt and the tokens
    # already sent, this many times at most; then the client gets the error. 0 = never
    # (gateway/core/resume.py).
    stream_resumes: int = 1
    # A streamed reply that sent nothing for this many seconds (a long prefill, a queue, a
    # tool call held back until it parses) gets the API's harmless keep-alive: an empty
    # chunk (OpenAI chat, completions), response.in_progress (Responses), a `ping` event
    # (Anthropic), each what its agent clients count (tests/fixtures/keepalive.json); Ollama's
    # NDJSON gets none (gateway/http/wire.py). Proxies (nginx: 60 s) and client read
    # timeouts would otherwise drop it. 0 = never.
    stream_keepalive_seconds: float = 15.0
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


def is_loopback_host(host: str) -> bool:
    """`localhost` or a loopback address: reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # NOTE: another name may resolve to anything; treated as remote

