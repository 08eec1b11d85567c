"""`npx-supervisor launch`'s plans: each client pointed at the server without touching the
user's own config (the real runs are in tests/test_real_clients.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from npu_proxy.protocol.config import Config
from npu_proxy.supervisor.launch import LaunchError, plan, private_folder, server_url

URL = "http://127.0.0.1:11435"


def _no_folder() -> Path:
    raise AssertionError("a client that reads no file got a folder")


def test_server_url_of_a_wildcard_bind_is_loopback() -> None:
    assert server_url(Config(host="0.0.0.0", port=1234)) == "http://127.0.0.1:1234"
    assert server_url(Config(host="::1", port=1234)) == "http://[::1]:1234"


def test_claude_is_told_the_server_the_model_and_the_context() -> None:
    steps = plan("claude", URL, "m:1", "k", 8192, ["-p", "hi"], "/bin/claude", _no_folder)
    assert steps.argv == ["/bin/claude", "--model", "m:1", "-p", "hi"]
    assert steps.env["ANTHROPIC_BASE_URL"] == URL and steps.env["ANTHROPIC_API_KEY"] == "k"
    assert steps.env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "8192"
    # NOTE: at 8192 Claude Code sends with 1024 reserved for the reply, refuses with 2048.
    assert steps.env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "1024"
    assert steps.files == {}


def test_codex_gets_its_provider_on_the_command_line() -> None:
    steps = plan("codex", URL, "m:1", "k", 32768, ["exec", "hi"], "/bin/codex", _no_folder)
    flags = steps.argv[1:-2]
    assert flags[::2] == ["-c"] * (len(flags) // 2)
    overrides = dict(f.split("=", 1) for f in flags[1::2])
    assert json.loads(overrides["model_providers.npuproxy.base_url"]) == f"{URL}/v1"
    assert overrides["model_providers.npuproxy.wire_api"] == '"responses"'
    assert overrides["model_context_window"] == "32768"
    assert steps.argv[-2:] == ["exec", "hi"] and steps.env == {"NPU_PROXY_API_KEY": "k"}
    assert steps.files == {}


def test_opencode_reads_a_config_of_the_launchers_own(tmp_path: Path) -> None:
    steps = plan("opencode", URL, "m:1", "k", 8192, ["run", "hi"], "/bin/opencode",
                 lambda: tmp_path)
    (path, text), = steps.files.items()
    assert path.parent == tmp_path and steps.env["OPENCODE_CONFIG"] == str(path)
    provider = json.loads(text)["provider"]["npu-proxy"]
    assert provider["options"] == {"baseURL": f"{URL}/v1", "apiKey": "k"}
    assert provider["models"]["m:1"]["limit"] == {"context": 8192, "output": 1024}


def test_an_unknown_client_is_refused() -> None:
    with pytest.raises(LaunchError, match="one of claude, codex, opencode"):
        plan("vim", URL, "m", "k", 8192, [], "/bin/vim", _no_folder)


def test_launch_folders_of_clients_no_longer_running_are_removed(tmp_path: Path) -> None:
    """The launcher execs the client, so it cannot remove the folder it wrote for it; the
    next launch removes those whose process is gone (issue 46: nothing left behind)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tmp_path / f"npu-proxy-launch-opencode-{gone.pid}-abc"
    live = tmp_path / f"npu-proxy-launch-opencode-{os.getppid()}-def"
    other = tmp_path / "npu-proxy-launch-notes"
    for folder in (dead, live, other):
        folder.mkdir()
    (dead / "opencode.json").write_text("{}")
    new = private_folder("opencode", tmp_path)
    assert new.name.startswith(f"npu-proxy-launch-opencode-{os.getpid()}-") and new.is_dir()
    assert not dead.exists() and live.is_dir() and other.is_dir()
