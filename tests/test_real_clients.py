"""The agent clients people run, for real, against the shared test server and SmolLM2-135M:
Codex CLI (`codex exec` through a custom Responses provider and through `--oss --local-provider
ollama`), Claude Code (`claude -p` with ANTHROPIC_BASE_URL), opencode, qwen-code and
Continue's `cn`, the versions pinned in tests/clients/package.json that `make setup` installs
into .clients/ (skipped, with the reason, where node/npm or the install are missing).

Each client runs as a subprocess (tests/clientlaunch.py) with a private HOME (and CODEX_HOME)
under the test's tmp folder, a placeholder key, its update checks and telemetry off (the
node-based ones also get tests/clients/loopback_only.cjs, which fails every non-loopback name
lookup), against a capturing proxy (tests/clientcap.py) in front of the server. A run must
end as the client's user would want: the model's answer (exit 0, some output), or, where the
client's own first prompt is larger than the model's 8192-token context, the server's overflow
error in the shape that client acts on, with the client reporting it (Anthropic
`invalid_request_error` "prompt is too long: N tokens > M maximum"; OpenAI
`context_length_exceeded`).

The shapes of the requests each client sent (tests/fixtures/clients/shapes/<client>.json: fields,
types, roles, tool and content-block types, sizes, no prompt text) must still match, so a
client update that changes what it sends is noticed; tests/test_client_replay.py replays them
without node. Refresh the fixtures when a pinned version moves (after `make setup`):

    NPU_PROXY_REFRESH_CLIENT_SHAPES=1 .venv/bin/pytest -q tests/test_real_clients.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from clientcap import Exchange, signature
from clientlaunch import BUILDERS, KEY, LAUNCHED, PACKAGE, Run, describe, execute

FIXTURES = Path(__file__).parent / "fixtures" / "clients" / "shapes"
PINNED = json.loads((Path(__file__).parent / "clients" / "package.json").read_text())[
    "dependencies"]
# NOTE: opencode, qwen-code and cn send prompts that fit the context, so the model reads
# 2-8k tokens and answers: tens of seconds each on a loaded 2-core machine. Their tests are
# in the slow tier (marked slow: CI or NPU_PROXY_SLOW_TESTS=1, tests/conftest.py SLOW_TIER).
SLOW_CLIENTS = frozenset({"opencode", "qwen", "cn"})
REFRESH = bool(os.environ.get("NPU_PROXY_REFRESH_CLIENT_SHAPES"))
# NOTE: generous for a loaded 2-core machine; a client that hangs fails here, not the suite.
# The slow ones have the model read a prompt of up to ~8k tokens first (within pytest's 300 s).
TIMEOUT = 120.0
SLOW_TIMEOUT = 240.0
TOO_LONG = re.compile(r"^prompt is too long: (\d+) tokens > (\d+) maximum$")


_RUNS: dict[str, Run] = {}


@pytest.fixture(scope="module")
def client_run(tmp_path_factory: pytest.TempPathFactory,
               base_url: str) -> Iterator[Callable[[str], Run]]:
    """Runs a client once per module (its outcome and its shape test share the run)."""
    def run(name: str) -> Run:
        if name not in _RUNS:
            tmp = tmp_path_factory.mktemp(name)
            _RUNS[name] = execute(name, (BUILDERS | LAUNCHED)[name](tmp), tmp, base_url,
                                  SLOW_TIMEOUT if name in SLOW_CLIENTS else TIMEOUT)
        return _RUNS[name]
    yield run
    _RUNS.clear()


def _answered_or_overflowed(run: Run, path: str, overflow: Callable[[Any], bool],
                            client_says: str) -> Exchange:
    """The turn reached the model: an answer (exit 0, some output), or the overflow error
    in the shape the client acts on, which the client reports (exit 1)."""
    turns = run.inference(path)
    assert turns, describe(run)
    last = turns[-1]
    if last.status == 200:
        assert run.rc == 0, describe(run)
        assert run.out.strip(), describe(run)
    else:
        assert last.status == 400, describe(run)
        assert overflow(last.reply_json()), describe(run)
        assert run.rc == 1, describe(run)
        assert client_says in run.text, describe(run)
    return last


def _openai_overflow(body: Any) -> bool:
    error = body.get("error") or {}
    return bool(error.get("code") == "context_length_exceeded"
                and error.get("type") == "invalid_request_error")


def _anthropic_overflow(body: Any) -> bool:
    error = body.get("error") or {}
    match = TOO_LONG.match(error.get("message", ""))
    return bool(body.get("type") == "error" and error.get("type") == "invalid_request_error"
                and match and int(match[1]) > int(match[2]))


def test_codex_exec_through_a_responses_provider(client_run: Callable[[str], Run]) -> None:
    run = client_run("codex")
    turn = _answered_or_overflowed(run, "/v1/responses", _openai_overflow,
                                   "ran out of room in the model's context window")
    assert turn.headers.get("authorization") == f"Bearer {KEY}"


def test_codex_exec_oss_ollama_provider(client_run: Callable[[str], Run]) -> None:
    run = client_run("codex-oss")
    probes = [(e.method, e.path) for e in run.proxy.exchanges]
    assert ("GET", "/api/version") in probes, describe(run)
    version = next(e for e in run.proxy.exchanges if e.path == "/api/version")
    assert version.status == 200, describe(run)
    assert "too old" not in run.text, describe(run)
    # NOTE: the model is listed in /api/tags, so codex must not try to pull it.
    assert ("POST", "/api/pull") not in probes, describe(run)
    _answered_or_overflowed(run, "/v1/responses", _openai_overflow,
                            "ran out of room in the model's context window")


def test_claude_code_print_mode(client_run: Callable[[str], Run]) -> None:
    run = client_run("claude")
    _answered_or_overflowed(run, "/v1/messages", _anthropic_overflow, "Prompt is too long")


def test_claude_code_told_the_context_length(client_run: Callable[[str], Run]) -> None:
    """CLAUDE_CODE_MAX_CONTEXT_TOKENS/MAX_OUTPUT_TOKENS: Claude Code asks for 1024 tokens of
    reply; its own ~49 KB first prompt still does not fit 8192 tokens, so the server's
    "prompt is too long" is what it must get and report."""
    run = client_run("claude-fitted")
    turn = _answered_or_overflowed(run, "/v1/messages", _anthropic_overflow,
                                   "Prompt is too long")
    assert turn.json()["max_tokens"] == 1024


def test_launch_claude(client_run: Callable[[str], Run]) -> None:
    """`npx-supervisor launch claude`: Claude Code reaches the server with the model, told
    the context (it reserves 1024 tokens of reply, not 32000), and answers or reports the
    overflow."""
    run = client_run("launch-claude")
    turn = _answered_or_overflowed(run, "/v1/messages", _anthropic_overflow,
                                   "Prompt is too long")
    assert turn.json()["model"] == "smollm2:135m" and turn.json()["max_tokens"] == 1024


def test_launch_codex(client_run: Callable[[str], Run]) -> None:
    """`npx-supervisor launch codex`: Codex's Responses provider given on its command line
    (its own config.toml untouched) reaches the server with the model."""
    run = client_run("launch-codex")
    turn = _answered_or_overflowed(run, "/v1/responses", _openai_overflow,
                                   "ran out of room in the model's context window")
    assert turn.json()["model"] == "smollm2:135m"


def test_launch_names_a_missing_client(tmp_path: Path) -> None:
    """Not on PATH: said, with the npm command that installs it."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([str(Path(sys.executable).parent / "npx-supervisor"), "launch", "codex"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "npm install -g @openai/codex" in done.stderr


@pytest.mark.slow
def test_opencode_run(client_run: Callable[[str], Run]) -> None:
    run = client_run("opencode")
    _answered_or_overflowed(run, "/v1/chat/completions", _openai_overflow, "")


@pytest.mark.slow
def test_qwen_code_prompt(client_run: Callable[[str], Run]) -> None:
    run = client_run("qwen")
    _answered_or_overflowed(run, "/v1/chat/completions", _openai_overflow, "API Error: 400")


@pytest.mark.slow
def test_continue_cli_prompt(client_run: Callable[[str], Run]) -> None:
    run = client_run("cn")
    _answered_or_overflowed(run, "/v1/chat/completions", _openai_overflow,
                            "Context length exceeded")


def _fixture(name: str, run: Run) -> dict[str, Any]:
    return {"client": name, "package": PACKAGE[name], "version": PINNED[PACKAGE[name]],
            "refresh": "NPU_PROXY_REFRESH_CLIENT_SHAPES=1 .venv/bin/pytest -q "
                       "tests/test_real_clients.py",
            "requests": _distinct([e.shape() for e in run.proxy.exchanges])}


def _distinct(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per distinct (method, path, body signature), in the order first sent."""
    seen: set[str] = set()
    out = []
    for r in requests:
        key = json.dumps([r["method"], r["path"], signature(r["body"])], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _key(request: dict[str, Any]) -> tuple[str, str, str]:
    return (request["method"], request["path"].split("?")[0],
            json.dumps(signature(request["body"]), sort_keys=True))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n in SLOW_CLIENTS else n for n in BUILDERS])
def test_request_shapes_match_the_fixture(name: str, client_run: Callable[[str], Run]) -> None:
    """What the pinned client sends is what tests/fixtures/clients/shapes/<name>.json recorded: the
    same requests (method, path) and, for each body, the same structure (keys, types, roles,
    tool and content-block types, config values; string lengths and the order of an object's
    keys may differ: codex writes client_metadata from a hash map)."""
    run = client_run(name)
    path = FIXTURES / f"{name}.json"
    recorded = _fixture(name, run)
    if REFRESH:
        FIXTURES.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(recorded, indent=1) + "\n")
        pytest.skip(f"refreshed {path.name}")
    assert path.exists(), f"no fixture {path}: refresh with {recorded['refresh']}"
    fixture = json.loads(path.read_text())
    assert fixture["version"] == recorded["version"], f"refresh {path.name}: the pin moved"
    known = {_key(r) for r in fixture["requests"]}
    sent = [_key(r) for r in recorded["requests"]]
    assert sent, describe(run)
    first_turn = next(r for r in fixture["requests"] if r["body"] is not None)
    assert _key(first_turn) in sent, (
        f"{name} no longer sends its recorded first request: refresh {path.name} if the "
        "new shape is what the client means")
    for request in sent:
        assert request in known, (f"{name} sent a request of a shape not in {path.name}: "
                                  f"{request[0]} {request[1]} {request[2][:2000]}")
