"""How each agent client is started for tests/test_real_clients.py and
tests/test_client_tool_loop.py: its command, a clean environment (private HOME/CODEX_HOME, a
placeholder key, update checks and telemetry off) and its config files. `{PROXY}` in any of
them is the capturing proxy's URL, known at start. `execute` runs one against a capturing
proxy (tests/clientcap.py) in front of a server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from shutil import which

import pytest
from clientcap import CaptureProxy, Exchange
from serverctl import with_parent

LLM = "smollm2:135m"
ROOT = Path(__file__).resolve().parent.parent
CLIENTS = Path(os.environ.get("NPU_PROXY_TEST_CLIENTS", ROOT / ".clients")) / "node_modules"
PRELOAD = Path(__file__).parent / "clients" / "loopback_only.cjs"
KEY = "placeholder-key"
# The exit status of a run that timed out (kept as a run, so its shape test does not redo it).
TIMED_OUT = -1000
DONE = -1001  # stopped once its work was there (execute's `done`)
PROMPT = "Say OK"


@dataclass(frozen=True)
class Ask:
    """What a client is asked, with which model and limits. `act`: an agent task, the client
    allowed to write files and run commands in its working folder without asking (its own
    auto-approve mode); otherwise the tests' one-shot question."""
    prompt: str = PROMPT
    model: str = LLM
    context: int = 8192
    output: int = 32
    act: bool = False
    # A user with a small model: the client's extras (tools its tasks need none of, memory
    # and skills notes) turned off with its own switches, as docs/clients.md shows; its
    # own system prompt kept.
    trim: bool = False
    # A user with a small model: the client's own system prompt (8-12k tokens for Codex and
    # Qwen Code) replaced by SHORT_SYSTEM through the client's own switch (Codex
    # model_instructions_file, Claude Code and Qwen Code --system-prompt, OpenCode's build
    # agent prompt); cn and aider keep theirs (~2k and ~1k tokens).
    short: bool = False


ASK = Ask()
# The short system prompt (`{cwd}`: the task's folder; Claude Code's and Qwen Code's file
# tools take absolute paths, and without it the model guessed paths outside the folder).
SHORT_SYSTEM = ("You are a coding agent. The current directory is {cwd}. Use your tools to "
                "read and write files; do not ask questions. When the task is done, say so in "
                "one line.")
# Codex CLI 0.171's switches for the tools a task needs none of (its multi_agent namespace
# alone is ~11 kB of JSON in every request): ~4 kB of tools are left, from ~18.7 kB.
CODEX_TRIM = [f"features.{k}=false" for k in ("multi_agent", "goals", "image_generation",
                                              "view_image")] + ['web_search="disabled"']
# OpenCode 1.18's tools a task needs none of (its shell and file tools stay).
OPENCODE_TRIM = {"tools": {name: False for name in ("skill", "task", "todowrite", "webfetch")}}
# Qwen Code 0.24.4's settings that leave out its memory notes, its skills list, the tools of
# its own beside its core ones (agents, goals, worktrees, messages) and the core ones no task
# needs (schedules, monitors, notebooks, MCP resources, the web, images): its file, search
# and shell tools stay.
QWEN_TRIM = {
    "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False},
    "skills": {"disabledLevels": ["project", "user", "extension", "bundled"]},
    "goals": {"modelProposed": "disabled"},
    "tools": {"disabled": ["agent", "list_agents", "get_goal", "update_goal", "skill",
                           "tool_search", "tool_call", "enter_worktree", "exit_worktree",
                           "record_artifact", "report_findings", "send_message", "task_stop",
                           "cron_create", "cron_delete", "cron_list", "loop_wakeup", "monitor",
                           "notebook_edit", "read_mcp_resource", "web_fetch", "zoom_image"]},
}


@dataclass
class Launch:
    """How to start a client; `{PROXY}` in argv, env and files is the capturing proxy's URL."""
    argv: list[str]
    env: dict[str, str]
    files: dict[Path, str]


def _binary(rel: str) -> Path:
    path = CLIENTS / rel
    if not path.exists():
        pytest.skip(f"{rel.split('/node_modules/')[-1]} not installed ({path} missing): "
                    "`make setup` installs the agent clients where node and npm are")
    return path


def _node() -> str:
    node = which("node")
    if node is None:
        pytest.skip("node not found: the node-based agent clients need it")
    return node


def _base_env(home: Path) -> dict[str, str]:
    """A clean environment: none of the developer's own keys, base URLs or configs; its
    temporary folder inside the test's (the launcher's and the clients' own temporary files
    go with the test's folder, which tests/reaper.py removes)."""
    home.mkdir(parents=True, exist_ok=True)
    tmp = home.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
            "TMPDIR": str(tmp),
            "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1",
            "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
            "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state")}


CODEX_CONFIG = """\
model = "{model}"
{provider}check_for_update_on_startup = false
approval_policy = "never"
sandbox_mode = "{sandbox}"
[analytics]
enabled = false
[feedback]
enabled = false
# NOTE: without these three codex syncs its curated plugins from github.com and chatgpt.com.
[features]
plugins = false
remote_plugin = false
apps = false
"""
CODEX_PROVIDER = """\
[model_providers.npuproxy]
name = "npu-proxy"
base_url = "{PROXY}/v1"
env_key = "NPU_PROXY_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
"""


def _codex(tmp: Path, oss: bool, ask: Ask = ASK) -> Launch:
    codex = _binary("@openai/codex/bin/codex.js")
    env = _base_env(tmp / "home")
    home = tmp / "codex-home"
    provider = "" if oss else 'model_provider = "npuproxy"\n'
    config = CODEX_CONFIG.format(model=ask.model, provider=provider,
                                 sandbox="workspace-write" if ask.act else "read-only")
    if not oss:
        config += CODEX_PROVIDER
    env |= {"CODEX_HOME": str(home), "NPU_PROXY_API_KEY": KEY}
    argv = [_node(), str(codex), "exec", "--skip-git-repo-check"]
    if oss:
        env["CODEX_OSS_BASE_URL"] = "{PROXY}/v1"
        argv += ["--oss", "--local-provider", "ollama", "-m", ask.model]
    if ask.trim:
        argv += [p for c in CODEX_TRIM for p in ("-c", c)]
    files = {home / "config.toml": config}
    if ask.short:
        instructions = tmp / "instructions.md"
        files[instructions] = SHORT_SYSTEM.format(cwd=tmp / "work") + "\n"
        argv += ["-c", f"model_instructions_file={json.dumps(str(instructions))}"]
    return Launch([*argv, ask.prompt], env, files)


def _claude(tmp: Path, extra: dict[str, str], ask: Ask = ASK) -> Launch:
    claude = _binary("@anthropic-ai/claude-code/bin/claude.exe")
    if claude.stat().st_size < 1_000_000:
        pytest.skip("Claude Code's native binary was not put in place (its postinstall did "
                    "not run): `make setup` allows that script in tests/clients/package.json")
    env = _base_env(tmp / "home")
    env |= {"CLAUDE_CONFIG_DIR": str(tmp / "home" / ".claude"),
            "ANTHROPIC_BASE_URL": "{PROXY}", "ANTHROPIC_API_KEY": KEY,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1", **extra}
    argv = [str(claude), "-p", ask.prompt, "--model", ask.model]
    if ask.act:
        # NOTE: its background requests (titles, summaries) go to the same model, and it is
        # told the context and reply `npx-supervisor launch claude` tells it (without them it
        # assumes an unknown model holds 1M tokens, and says so).
        env |= {"ANTHROPIC_SMALL_FAST_MODEL": ask.model,
                "ANTHROPIC_DEFAULT_HAIKU_MODEL": ask.model,
                "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(ask.context),
                "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(ask.output)}
        argv += ["--permission-mode", "acceptEdits", "--allowedTools",
                 "Bash,Read,Write,Edit,Glob,Grep,LS"]
    if ask.trim:
        argv += ["--tools", "Bash,Read,Write,Edit,Glob,Grep"]
    if ask.short:
        argv += ["--system-prompt", SHORT_SYSTEM.format(cwd=tmp / "work")]
    return Launch(argv, env, {})


def _opencode(tmp: Path, ask: Ask = ASK) -> Launch:
    opencode = _binary("opencode-ai/bin/opencode.exe")
    env = _base_env(tmp / "home")
    config = tmp / "opencode.json"
    settings: dict[str, object] = {
        "$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
        "model": f"npuproxy/{ask.model}",
        "provider": {"npuproxy": {
            "npm": "@ai-sdk/openai-compatible", "name": "npu-proxy",
            "options": {"baseURL": "{PROXY}/v1", "apiKey": KEY},
            "models": {ask.model: {"name": ask.model, "limit": {
                "context": ask.context, "output": ask.output}}}}}}
    if ask.act:
        settings["permission"] = {"edit": "allow", "bash": "allow", "webfetch": "deny"}
    if ask.trim:
        settings |= OPENCODE_TRIM
    if ask.short:
        settings["agent"] = {"build": {"prompt": SHORT_SYSTEM.format(cwd=tmp / "work")}}
    text = json.dumps(settings)
    env |= {"OPENCODE_CONFIG": str(config)} | {f"OPENCODE_DISABLE_{k}": "1" for k in (
        "AUTOUPDATE", "MODELS_FETCH", "SHARE", "LSP_DOWNLOAD", "DEFAULT_PLUGINS", "CLAUDE_CODE",
        "EXTERNAL_SKILLS")}
    return Launch([str(opencode), "run", ask.prompt], env, {config: text})


def _qwen(tmp: Path, ask: Ask = ASK) -> Launch:
    qwen = _binary("@qwen-code/qwen-code/cli-entry.js")
    env = _base_env(tmp / "home")
    settings = tmp / "home" / ".qwen" / "settings.json"
    text = json.dumps({
        "security": {"auth": {"selectedType": "openai"}}, "selectedAuthType": "openai",
        "privacy": {"usageStatisticsEnabled": False}, "usageStatisticsEnabled": False,
        "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
        "model": {"name": ask.model}} | (QWEN_TRIM if ask.trim else {}))
    env |= {"OPENAI_API_KEY": KEY, "OPENAI_BASE_URL": "{PROXY}/v1", "OPENAI_MODEL": ask.model,
            "NODE_OPTIONS": f"--require {PRELOAD}"}
    argv = [_node(), str(qwen), "-p", ask.prompt, *(["--yolo"] if ask.act else [])]
    if ask.short:
        argv += ["--system-prompt", SHORT_SYSTEM.format(cwd=tmp / "work")]
    return Launch(argv, env, {settings: text})


def _cn(tmp: Path, ask: Ask = ASK) -> Launch:
    cn = _binary("@continuedev/cli/dist/cn.js")
    env = _base_env(tmp / "home")
    config = tmp / "config.yaml"
    text = (
        "name: npu-proxy-local\nversion: 0.0.1\nschema: v1\nmodels:\n"
        f"  - name: smollm2\n    provider: openai\n    model: {ask.model}\n"
        "    apiBase: {PROXY}/v1\n" f"    apiKey: {KEY}\n    roles: [chat, edit, apply]\n"
        f"    defaultCompletionOptions:\n      contextLength: {ask.context}\n"
        f"      maxTokens: {ask.output}\n")
    env |= {"CONTINUE_GLOBAL_DIR": str(tmp / "home" / ".continue"),
            "CONTINUE_CLI_ENABLE_TELEMETRY": "0", "CONTINUE_METRICS_ENABLED": "0",
            "CONTINUE_CLI_AUTO_UPDATED": "1", "NODE_OPTIONS": f"--require {PRELOAD}"}
    argv = [_node(), str(cn), "-p", ask.prompt, "--config", str(config),
            *(["--auto"] if ask.act else [])]
    return Launch(argv, env, {config: text})


# aider: a Python client, pinned in tests/clients/aider.txt, installed by `make setup` into a
# venv of its own beside the node clients.
AIDER = CLIENTS.parent / "aider" / "bin" / "aider"


def _aider(tmp: Path, ask: Ask = ASK) -> Launch:
    """aider as its users run it: the files of its working folder (as the bench wrote them)
    added on its command line, the request in `--message`, every question answered yes. It
    edits files in its own text format (whole files, for a model it does not know) and calls
    no tools. Its model's context and reply are told in a model-metadata file; litellm's
    price list is its own copy, not fetched."""
    if not AIDER.exists():
        pytest.skip(f"aider not installed ({AIDER} missing): `make setup` installs it")
    env = _base_env(tmp / "home")
    metadata = tmp / "aider-models.json"
    model = f"openai/{ask.model}"
    text = json.dumps({model: {
        "max_input_tokens": ask.context, "max_output_tokens": ask.output,
        "max_tokens": ask.output, "input_cost_per_token": 0.0, "output_cost_per_token": 0.0,
        "litellm_provider": "openai", "mode": "chat"}})
    env |= {"OPENAI_API_BASE": "{PROXY}/v1", "OPENAI_API_KEY": KEY,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True", "AIDER_ANALYTICS": "false"}
    work = tmp / "work"
    files = sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file()) \
        if work.is_dir() else []
    argv = [str(AIDER), "--model", model, "--model-metadata-file", str(metadata),
            "--no-git", "--no-auto-commits", "--yes-always", "--no-check-update",
            "--analytics-disable", "--no-show-model-warnings", "--no-show-release-notes",
            "--no-pretty", "--no-fancy-input", "--no-detect-urls", "--no-notifications",
            "--no-suggest-shell-commands", "--map-tokens", "0",
            *files, "--message", ask.prompt]
    return Launch(argv, env, {metadata: text})


Builder = Callable[[Path], Launch]
# Each client as an agent: the same launches, asked something else (bench/agents.py).
ASKED: dict[str, Callable[[Path, Ask], Launch]] = {
    "codex": lambda tmp, ask: _codex(tmp, False, ask),
    "claude": lambda tmp, ask: _claude(tmp, {}, ask),
    "opencode": _opencode,
    "qwen": _qwen,
    "cn": _cn,
    "aider": _aider,
}
CLAUDE_FITTED = {"CLAUDE_CODE_MAX_CONTEXT_TOKENS": "8192", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1024"}
BUILDERS: dict[str, Builder] = {
    "codex": lambda tmp: _codex(tmp, oss=False),
    "codex-oss": lambda tmp: _codex(tmp, oss=True),
    "claude": lambda tmp: _claude(tmp, {}),
    "claude-fitted": lambda tmp: _claude(tmp, CLAUDE_FITTED),
    "opencode": _opencode,
    "qwen": _qwen,
    "cn": _cn,
}


def launched(tmp: Path, client: str, args: list[str], model: str = LLM) -> Launch:
    """`npx-supervisor launch CLIENT` as a user runs it: the client found on PATH, everything
    else told by the launcher (URL, key, model, context length)."""
    claude = _binary("@anthropic-ai/claude-code/bin/claude.exe")  # skips without the clients
    env = _base_env(tmp / "home")
    env["PATH"] = f"{claude.parent.parent.parent.parent / '.bin'}:{env['PATH']}"
    env |= {"NPU_PROXY_PORT": "{PROXY_PORT}", "NPU_PROXY_HOST": "127.0.0.1",
            "CODEX_HOME": str(tmp / "home" / ".codex"), "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1"}
    (tmp / "home" / ".codex").mkdir(parents=True, exist_ok=True)
    supervisor = Path(sys.executable).parent / "npx-supervisor"
    return Launch([str(supervisor), "launch", client, "--model", model, "--", *args], env, {})


CODEX_QUIET = [f"features.{k}=false" for k in ("plugins", "remote_plugin", "apps")] + [
    "check_for_update_on_startup=false"]
# The clients started through `npx-supervisor launch` (tests/test_launch.py).
LAUNCHED: dict[str, Builder] = {
    "launch-claude": lambda tmp: launched(tmp, "claude", ["-p", PROMPT]),
    "launch-codex": lambda tmp: launched(tmp, "codex", [
        "exec", "--skip-git-repo-check", *[p for c in CODEX_QUIET for p in ("-c", c)], PROMPT]),
}
PACKAGE = {"codex": "@openai/codex", "codex-oss": "@openai/codex",
           "claude": "@anthropic-ai/claude-code", "claude-fitted": "@anthropic-ai/claude-code",
           "opencode": "opencode-ai", "qwen": "@qwen-code/qwen-code", "cn": "@continuedev/cli"}


@dataclass
class Run:
    """A client's run: its exit status (TIMED_OUT, DONE), output, and the exchanges
    recorded."""
    name: str
    rc: int
    out: str
    err: str
    proxy: CaptureProxy

    @property
    def text(self) -> str:
        return self.out + self.err

    def inference(self, path: str) -> list[Exchange]:
        return [e for e in self.proxy.inference() if e.path.split("?")[0] == path]


def execute(name: str, launch: Launch, tmp: Path, base_url: str, timeout: float,
            done: Callable[[CaptureProxy], bool] | None = None) -> Run:
    """Runs the client in `tmp`/work against a capturing proxy in front of `base_url`. With
    `done`, the client is stopped (exit DONE) once the work it was asked for is there, as
    `done` judges from the folder and the exchanges so far: what it says afterwards is not
    waited for."""
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    proxy = CaptureProxy(base_url, read_timeout=timeout)
    port = proxy.url.rsplit(":", 1)[1]
    env = {k: v.replace("{PROXY}", proxy.url).replace("{PROXY_PORT}", port)
           for k, v in launch.env.items()}
    argv = [a.replace("{PROXY}", proxy.url) for a in launch.argv]
    for path, text in launch.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.replace("{PROXY}", proxy.url))
    deadline = time.monotonic() + timeout
    try:
        with (tmp / f"{name}.out").open("w+") as out, (tmp / f"{name}.err").open("w+") as err:
            # NOTE: in a process group of its own, so that a stop takes the client's children
            # too, ended with this process: a SIGKILLed test run left Codex running.
            proc = subprocess.Popen(with_parent(argv, group=True), env=env, cwd=work,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True)
            rc = _wait(proc, deadline, lambda: done is not None and done(proxy))
            out.seek(0)
            err.seek(0)
            text, errors = out.read(), err.read()
    finally:
        proxy.close()
    return Run(name, rc, text, errors, proxy)


def _wait(proc: subprocess.Popen[str], deadline: float, done: Callable[[], bool]) -> int:
    """The client's exit status; TIMED_OUT past `deadline`, DONE once `done()` (the client
    and its children then stopped: SIGTERM, SIGKILL after a grace)."""
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        finished = done()
        if finished or time.monotonic() > deadline:
            _stop(proc)
            return DONE if finished else TIMED_OUT


def _stop(proc: subprocess.Popen[str]) -> None:
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            proc.send_signal(sig)  # NOTE: gone, or its wrapper has not made its group yet
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def describe(run: Run) -> str:
    """The run and every exchange, for an assertion's message."""
    lines = [f"{run.name}: exit {run.rc}", f"stdout: {run.out[-1500:]}",
             f"stderr: {run.err[-1500:]}"]
    for e in run.proxy.exchanges:
        lines.append(f"{e.method} {e.path} {len(e.body)}B -> {e.status} {e.reply[:400]!r}")
    return "\n".join(lines)
