"""What a model's `capabilities` promise, checked against what the server does with it.

`check_capabilities(http, name)` is meant for any served model (an embedded one, a pulled one,
one made by /api/create): it asserts that /api/show, /api/tags and /v1/models report the same
capabilities, and that every request needing a capability is served exactly when the model
has it and is a 400 otherwise. It returns the capabilities.
"""

from __future__ import annotations

from typing import Any

import httpx

ONE = {"num_predict": 1, "temperature": 0}
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "The time now",
    "parameters": {"type": "object", "properties": {}}}}]


def _probes(name: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """A cheap request per capability (at most one generated token)."""
    user = {"role": "user", "content": "hi"}
    return {
        "completion": ("/api/generate", {"model": name, "prompt": ""}),  # a load request
        "embedding": ("/api/embed", {"model": name, "input": "hi"}),
        "tools": ("/api/chat", {"model": name, "messages": [user], "tools": TOOLS,
                                "options": ONE}),
        "vision": ("/api/chat", {"model": name, "options": ONE,
                                 "messages": [{**user, "images": ["aGk="]}]}),
        "insert": ("/api/generate", {"model": name, "prompt": "def f(", "suffix": "\n",
                                     "options": ONE}),
        "thinking": ("/api/chat", {"model": name, "messages": [user], "think": True,
                                   "options": ONE}),
        "rerank": ("/v1/rerank", {"model": name, "query": "hi", "documents": ["hi"]}),
    }


def check_capabilities(http: httpx.Client, name: str) -> list[str]:
    shown = http.post("/api/show", json={"model": name})
    assert shown.status_code == 200, shown.text
    caps: list[str] = shown.json()["capabilities"]
    tags = {m["model"]: m for m in http.get("/api/tags").json()["models"]}
    tagged = tags.get(name) or tags[f"{name}:latest"]
    assert tagged["capabilities"] == caps
    card = http.get(f"/v1/models/{name}").json()
    assert card["capabilities"] == caps
    listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert listed[card["id"]]["capabilities"] == caps
    assert listed[card["id"]]["max_model_len"] == card["max_model_len"] >= 0
    for capability, (path, body) in _probes(name).items():
        r = http.post(path, json={**body, "stream": False})
        if capability in caps:
            assert r.status_code == 200, (capability, r.text)
        else:
            assert r.status_code == 400, (capability, r.text)
            error = r.json()["error"]
            # NOTE: /v1/rerank answers in OpenAI's shape, the others in Ollama's.
            assert isinstance(error["message"] if path.startswith("/v1/") else error, str)
    return caps
