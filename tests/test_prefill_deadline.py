"""A long prompt's reading does not count against the deadline meant for the generation.

An agent's first turn (12k tokens) took 8 minutes to read on 2 CPU cores, past the default
inference_timeout (180 s): the request was cut before its first token, and the agent's
retry was cut again (issue 42). The worker now moves a generation's deadline by the time its
prompt may take at `min_prefill_rate` tokens/s, and tells the gateway in its Accepted frame.

The worker's test hook `hold_start_dir` holds a request after it was accepted (the response's
headers are out) and before its first step, until a file named after its X-Request-ID exists:
a prefill as long as the test makes it, on any machine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serverctl import Server, gated_server, small_llm

from npu_proxy.protocol.config import ConfigError, load_config

LLM = "smollm2:135m"
TIMEOUT = 2.0  # inference_timeout
RATE = 2.0  # min_prefill_rate, tokens/s
LONG = "one two three four five six seven eight nine ten " * 6  # ~60 tokens: ~30 s more


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # NOTE: the small model (serverctl.small_llm): the prefill is the test's hold, and the
    # allowance counts the prompt's tokens (the same tokenizer); it never ends by itself, so
    # a generation ends at its 3 tokens or at its deadline.
    server = gated_server(tmp_path_factory.mktemp("prefill"), {"min_prefill_rate": RATE},
                          inference_timeout=TIMEOUT, models=small_llm())
    yield server
    server.stop()


def _generate(srv: Server, rid: str, prompt: str, hold: float) -> dict[str, Any]:
    """Ollama's /api/generate, held `hold` seconds after its headers came (the worker had
    accepted it), as a prefill that long would; its last line."""
    body = {"model": LLM, "prompt": prompt, "raw": True, "options": {"num_predict": 3}}
    with httpx.stream("POST", srv.url + "/api/generate", json=body, timeout=120,
                      headers={"X-Request-ID": rid}) as r:
        assert r.status_code == 200
        time.sleep(hold)  # NOTE: wall time past the deadline is what this test is about
        (srv.gates / rid).touch()
        lines: list[dict[str, Any]] = [json.loads(line) for line in r.iter_lines() if line.strip()]
    return lines[-1]


def test_a_long_prompts_reading_is_not_cut_by_the_generations_deadline(srv: Server) -> None:
    # Held past inference_timeout and past the gateway's own grace after it (5 s): only the
    # prompt's allowance, at the worker and at the gateway, lets it generate.
    last = _generate(srv, "long-prompt", LONG, hold=TIMEOUT + 6.0)
    assert last.get("done") is True, last
    assert last["prompt_eval_count"] / RATE > TIMEOUT + 6.0 + 5.0, last
    assert last["done_reason"] == "length", last
    assert last["eval_count"] == 3


def test_a_short_prompt_still_ends_at_the_deadline(srv: Server) -> None:
    # A 1-token prompt gets half a second more: held 3 s, it ends at its deadline, never
    # generating its 3 tokens. NOTE: ended by its worker (done_reason timeout) or, where the
    # worker was starved on a loaded machine for the 4.5 s left after the hold (CI61), by the
    # gateway, which gives up 5 s past the deadline: either way it ends there.
    last = _generate(srv, "short-prompt", "Hi", hold=TIMEOUT + 1.0)
    if "error" in last:
        assert "stopped producing output past the request's deadline" in last["error"], last
    else:
        assert last["done_reason"] == "timeout", last
        assert last["eval_count"] < 3


def test_a_negative_rate_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[[workers]]\nname = "llm"\nrole = "llm"\nmin_prefill_rate = -1\n')
    with pytest.raises(ConfigError, match="min_prefill_rate must be >= 0"):
        load_config(config, env={})
