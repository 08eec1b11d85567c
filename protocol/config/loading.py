"""Building the configuration: defaults < TOML file < `NPU_PROXY_*` environment < flags, and
the JSON copy the supervisor hands its children."""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from npu_proxy.protocol.config.root import Config
from npu_proxy.protocol.config.workers import default_workers

log = logging.getLogger(__name__)


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
ENV_VARS: dict[str, tuple[str, Callable[[str], Any]]] = {
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


# Settings an earlier version read and this one no longer has: a config file that still sets
# them starts, with a warning, rather than failing on an unknown key (every other unknown key
# is an error, so a typo never becomes a setting that silently does nothing).
RETIRED = {"heartbeat_interval": "a constant now; heartbeat_timeout is the setting",
           "converter_python": "the embedded Whisper is built without torch now"}
RETIRED_MODEL_KEYS = {"description": "never read"}


def _drop_retired(data: dict[str, Any]) -> None:
    for key, why in RETIRED.items():
        if data.pop(key, None) is not None:
            log.warning("setting %r is no longer read (%s): ignored", key, why)
    models = data.get("models")
    if isinstance(models, dict):
        for name, entry in models.items():
            for key, why in RETIRED_MODEL_KEYS.items():
                if isinstance(entry, dict) and entry.pop(key, None) is not None:
                    log.warning("setting models.%s.%s is no longer read (%s): ignored",
                                name, key, why)


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
    for var, (field, kind) in ENV_VARS.items():
        if var in env:
            try:
                data[field] = kind(env[var])
            except ValueError as exc:
                raise ConfigError(f"{var}={env[var]!r}: {exc}") from exc
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    _drop_retired(data)
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
