"""System turns after the first message, on a model whose chat template refuses them.

Claude Code sends a `system` turn after the user's message in every request (its agents and
skills lists, its environment); LangChain agents steer with them too. Some templates refuse
any system message but the first (newer Qwen's "System message must be at the beginning",
Gemma's and Mistral's role-alternation guards), so every such request was that template's
400. Now, where the template refuses, the system turns' texts are joined, in their order,
into one leading system message, as agent proxies do for models that predate mid-conversation
system messages. A template that takes them (Qwen2.5's, SmolLM2's) still gets them where they
were, on the OpenAI and Ollama APIs (the Anthropic API appends them to its system prompt:
test_client_shapes' A-system-turn). The model is SmolLM2-135M under a template with that
guard, on a server of its own; what it writes is not asserted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serverctl import Server

from npu_proxy.models.locate import locate

LLM = "smollm2:135m"
STRICT = "strict-system:135m"
TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "{%- if 'FORBIDDEN' in m.content %}{{ raise_exception('No forbidden words.') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FIRST, LATER = "You are terse.", "Available agent types: none."
ANTHROPIC = {"anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("system-turns")
    gguf = locate(Server(tmp / "probe").config, LLM).path
    srv = Server(tmp, workers=[{"name": "llm", "role": "llm", "model": STRICT}],
                 models={STRICT: {"path": str(gguf), "chat_template": TEMPLATE}}).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def strict(strict_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=strict_server.url, timeout=120) as http:
        yield http


def _count(http: httpx.Client, messages: list[dict[str, Any]]) -> int:
    r = http.post("/tokenize", json={"model": STRICT, "messages": messages})
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def test_later_system_turns_join_the_first(strict: httpx.Client) -> None:
    later = [{"role": "system", "content": FIRST}, {"role": "user", "content": "Hi"},
             {"role": "system", "content": LATER}]
    joined = [{"role": "system", "content": f"{FIRST}\n\n{LATER}"},
              {"role": "user", "content": "Hi"}]
    assert _count(strict, later) == _count(strict, joined)
    chat = strict.post("/v1/chat/completions", json={
        "model": STRICT, "messages": later, "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == _count(strict, joined)
    ollama = strict.post("/api/chat", json={"model": STRICT, "messages": later,
                                            "stream": False, "options": {"num_predict": 2}})
    assert ollama.status_code == 200, ollama.text
    assert ollama.json()["prompt_eval_count"] == _count(strict, joined)


def test_claude_codes_request_shape_is_served(strict: httpx.Client) -> None:
    body: dict[str, Any] = {
        "model": STRICT, "max_tokens": 2, "system": [{"type": "text", "text": FIRST}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                     {"role": "system", "content": [{"type": "text", "text": LATER}]}]}
    sent = strict.post("/v1/messages", json=body, headers=ANTHROPIC)
    assert sent.status_code == 200, sent.text
    counted = strict.post("/v1/messages/count_tokens", headers=ANTHROPIC, json={
        k: body[k] for k in ("model", "system", "messages")})
    assert counted.status_code == 200, counted.text
    assert sent.json()["usage"]["input_tokens"] == counted.json()["input_tokens"] == _count(
        strict, [{"role": "system", "content": f"{FIRST}\n\n{LATER}"},
                 {"role": "user", "content": "Hi"}])


def test_a_later_system_turn_alone_leads(strict: httpx.Client, strict_server: Server) -> None:
    later = [{"role": "user", "content": "Hi"}, {"role": "system", "content": LATER}]
    r = strict.post("/v1/chat/completions", json={"model": STRICT, "max_tokens": 2,
                                                  "messages": later})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == _count(strict, later[::-1])
    # Not silent: the worker's log names the request whose system turns were moved.
    said = [line for line in strict_server.worker_log("llm").splitlines()
            if "system turns joined" in line]
    assert any(r.headers["x-request-id"] in line for line in said), said


def test_other_template_refusals_stay_400s(strict: httpx.Client) -> None:
    """Only system turns are moved: the template's refusal of anything else is the request's
    400, with the template's words."""
    for messages in ([{"role": "user", "content": "FORBIDDEN"}],
                     [{"role": "user", "content": "FORBIDDEN"},
                      {"role": "system", "content": LATER}]):
        r = strict.post("/v1/chat/completions", json={"model": STRICT, "max_tokens": 2,
                                                      "messages": messages})
        assert r.status_code == 400, r.text
        assert "No forbidden words" in r.json()["error"]["message"]
