"""The one typed configuration object: every setting, the workers and the user's models."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from npu_proxy.protocol.config.limits import RequestLimits
from npu_proxy.protocol.config.models import ModelSource
from npu_proxy.protocol.config.server import is_loopback_host
from npu_proxy.protocol.config.workers import WorkerSpec, default_workers


def _default_workers() -> list[WorkerSpec]:
    return default_workers(["CPU"])


# The port whose instance keeps the plain folder name (every earlier release's).
_DEFAULT_PORT = 11435


def _default_runtime_dir(port: int) -> str:
    """One folder per instance: a user's server on another port (a second checkout, a test
    run beside a running server) gets a folder of its own, not "already runs"."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    suffix = "" if port == _DEFAULT_PORT else f"-{port}"
    return str(Path(base) / f"npu-proxy-{os.getuid()}{suffix}")


class Config(RequestLimits):
    """The effective configuration (server settings and request limits are inherited, so
    every setting stays a top-level key of the file and an attribute of this object)."""

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
        return Path(self.runtime_dir or _default_runtime_dir(self.port))

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


REDACTED = "<redacted>"


def redacted(config: Config) -> Config:
    """The configuration as it may be shown or logged: the API key replaced."""
    return msgspec.structs.replace(config, api_key=REDACTED) if config.api_key else config

