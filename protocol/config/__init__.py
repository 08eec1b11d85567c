"""The one typed configuration object, built once by the supervisor and handed to children.

Precedence: built-in defaults < TOML file < `NPU_PROXY_*` environment < command-line flags.
Children never read the environment: the supervisor writes the effective configuration as
JSON into the private runtime folder and passes its path.

Every setting lives in this package, one module per concept: server.py (address, transport,
logging, access, supervision), limits.py (the per-request budget), workers.py (a
`[[workers]]` section), models.py (a `[models."name:tag"]` entry), root.py (`Config`, the
whole), loading.py (file and environment), faults.py (test-only hooks). Each setting is
described in docs/settings.md (tests/test_settings.py keeps the two in step).
"""

from __future__ import annotations

from npu_proxy.protocol.config.faults import TEST_ONLY_FIELDS, FaultHooks
from npu_proxy.protocol.config.limits import RequestLimits
from npu_proxy.protocol.config.loading import (
    ENV_VARS,
    ConfigError,
    dump_config,
    load_config,
    read_config_file,
)
from npu_proxy.protocol.config.models import (
    DEFAULT_ASR_MODEL,
    DEFAULT_EMBED_MODEL,
    DEFAULT_LLM_MODEL,
    DEFAULT_RERANK_MODEL,
    DEFAULT_TTS_MODEL,
    ModelSource,
)
from npu_proxy.protocol.config.root import REDACTED, Config, redacted
from npu_proxy.protocol.config.server import ServerSettings, is_loopback_host
from npu_proxy.protocol.config.workers import (
    DEFAULT_WORKER_KEEP_ALIVE,
    Role,
    WorkerSpec,
    default_workers,
    speech_missing,
)

__all__ = [
    "DEFAULT_ASR_MODEL", "DEFAULT_EMBED_MODEL", "DEFAULT_LLM_MODEL", "DEFAULT_RERANK_MODEL",
    "DEFAULT_TTS_MODEL", "DEFAULT_WORKER_KEEP_ALIVE", "ENV_VARS", "REDACTED", "TEST_ONLY_FIELDS",
    "Config", "ConfigError", "FaultHooks", "ModelSource", "RequestLimits", "Role",
    "ServerSettings", "WorkerSpec", "default_workers", "dump_config", "is_loopback_host",
    "load_config", "read_config_file", "redacted", "speech_missing",
]
