"""`npx-supervisor launch claude|codex|opencode`: start an agent client pointed at this server.

As `ollama launch` does: the client gets this server's URL, a placeholder key (or the
configured one), the model and the context length it should assume, through its environment
and command-line overrides; the user's own config files are left as they are (opencode,
which reads only files, gets one of its own in a private folder). A missing client is named
with the npm command that installs it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from npu_proxy.protocol.config import Config

# The npm packages the clients come from, for the message when one is missing.
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex",
            "opencode": "opencode-ai"}
CLIENTS = tuple(PACKAGES)
# The key a client sends when the server wants none (every client insists on one).
PLACEHOLDER_KEY = "npu-proxy"
# What a client is told the context is when the server cannot be asked.
FALLBACK_CONTEXT = 8192


class LaunchError(Exception):
    """The client cannot be started: said to the user, exit status 1."""


@dataclass
class Plan:
    """What to run: the client's argv and the environment entries it gets on top of ours."""
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[Path, str] = field(default_factory=dict)


def server_url(config: Config) -> str:
    """The URL a client on this machine reaches the server at."""
    host = config.host
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{config.port}"


def context_length(url: str, model: str, key: str) -> int:
    """The model's context length as /api/show reports it; FALLBACK_CONTEXT when the server
    does not answer (the client still starts: the server may come up later)."""
    try:
        shown = httpx.post(f"{url}/api/show", json={"model": model}, timeout=10,
                           headers={"Authorization": f"Bearer {key}"}).json()
        info = shown.get("model_info", {})
        found = [v for k, v in info.items() if k.endswith(".context_length") and isinstance(v, int)]
    except (httpx.HTTPError, ValueError, AttributeError):
        return FALLBACK_CONTEXT
    return found[0] if found else FALLBACK_CONTEXT


def plan(client: str, url: str, model: str, key: str, context: int, args: list[str],
         binary: str, private: Callable[[], Path]) -> Plan:
    """The command and environment for `client`; `private` makes a folder of the launcher's
    own, called only for a client that reads a file (opencode's config)."""
    # NOTE: an eighth of the context for the reply, so that the client's own prompt has the
    # rest: Claude Code asks 32000 by default, and refuses to send at all ("Prompt is too
    # long") when its prompt plus the reply it reserves exceed the context it is told; at
    # 8192 tokens it sends with 1024 reserved, not with 2048.
    output = max(256, min(context // 8, 8192))
    if client == "claude":
        return Plan([binary, "--model", model, *args], {
            "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": key, "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model,
            "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(context),
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(output),
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"})
    if client == "codex":
        # NOTE: `-c` overrides take TOML values and leave ~/.codex/config.toml untouched.
        overrides = {
            "model": json.dumps(model), "model_provider": '"npuproxy"',
            "model_context_window": str(context),
            "model_providers.npuproxy.name": '"npu-proxy"',
            "model_providers.npuproxy.base_url": json.dumps(f"{url}/v1"),
            "model_providers.npuproxy.env_key": '"NPU_PROXY_API_KEY"',
            "model_providers.npuproxy.wire_api": '"responses"'}
        flags = [part for k, v in overrides.items() for part in ("-c", f"{k}={v}")]
        return Plan([binary, *flags, *args], {"NPU_PROXY_API_KEY": key})
    if client == "opencode":
        config = private() / "opencode.json"
        text = json.dumps({
            "$schema": "https://opencode.ai/config.json", "model": f"npu-proxy/{model}",
            "provider": {"npu-proxy": {
                "npm": "@ai-sdk/openai-compatible", "name": "npu-proxy",
                "options": {"baseURL": f"{url}/v1", "apiKey": key},
                "models": {model: {"name": model,
                                   "limit": {"context": context, "output": output}}}}}},
            indent=2)
        return Plan([binary, *args], {"OPENCODE_CONFIG": str(config)}, {config: text})
    raise LaunchError(f"unknown client {client!r}: one of {', '.join(CLIENTS)}")


def find_client(client: str) -> str:
    found = shutil.which(client)
    if found is None:
        raise LaunchError(f"{client} is not installed (not on PATH): install it with "
                          f"`npm install -g {PACKAGES[client]}`, then run this again")
    return found


# A launched client's folder: `npu-proxy-launch-<client>-<pid>-<random>` in the temporary
# folder, <pid> the launcher's, which the client keeps after exec.
_FOLDER = "npu-proxy-launch-"


def private_folder(client: str, tmp: Path | None = None) -> Path:
    """A new folder for the client's own files, named with this process's id (the client's
    once the launcher execs it); on POSIX, the folders of launched clients no longer running
    are removed first, so launches leave nothing behind in the temporary folder. (On
    Windows the launcher waits for the client and removes its folder itself.)"""
    tmp = Path(tempfile.gettempdir()) if tmp is None else tmp
    if os.name == "posix":
        for old in tmp.glob(_FOLDER + "*"):
            parts = old.name[len(_FOLDER):].split("-")
            pid = parts[-2] if len(parts) >= 3 else ""
            try:
                st = old.lstat()
                if not pid.isdigit() or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                    continue
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(old, ignore_errors=True)
            except OSError:
                continue  # NOTE: gone already, or a process of another user: kept
    return Path(tempfile.mkdtemp(prefix=f"{_FOLDER}{client}-{os.getpid()}-", dir=tmp))


def launch(config: Config, client: str, model: str, args: list[str]) -> int:
    """Start `client` against the server; its exit status (on POSIX the launcher becomes it)."""
    if client not in PACKAGES:
        raise LaunchError(f"unknown client {client!r}: one of {', '.join(CLIENTS)}")
    binary = find_client(client)
    url = server_url(config)
    key = config.api_key or PLACEHOLDER_KEY
    steps = plan(client, url, model, key, context_length(url, model, key), args, binary,
                 lambda: private_folder(client))
    for path, text in steps.files.items():
        path.write_text(text)
        path.chmod(0o600)
    env = {**os.environ, **steps.env}
    sys.stdout.flush()
    if os.name == "posix":
        os.execvpe(steps.argv[0], steps.argv, env)
    try:
        return subprocess.run(steps.argv, env=env, check=False).returncode
    finally:
        for path in steps.files:
            shutil.rmtree(path.parent, ignore_errors=True)
