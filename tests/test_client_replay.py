"""The agent clients' recorded request shapes (tests/fixtures/clients/shapes/, written by
tests/test_real_clients.py from real runs of the pinned clients) replayed without node: each
request rebuilt from its shape (every key, array element, type, role, tool and content block
and config value as the client sent them; short filler where the client wrote text) goes to
the shared server, which must accept it and start answering in that API's stream. So a server
change that refuses a client's shape is caught where the clients themselves are not installed.
A fixture named `<client>-<version>.json` is an earlier pin's record, kept for the shapes that
version sent and the current pin's run did not (users update their clients late).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from clientcap import synthesize

SHAPES = Path(__file__).parent / "fixtures" / "clients" / "shapes"
CASES = [
    pytest.param(fixture.stem, i, r,
                 id=f"{fixture.stem}-{i}-{r['method']}{r['path'].split('?')[0]}")
    for fixture in sorted(SHAPES.glob("*.json"))
    for i, r in enumerate(json.loads(fixture.read_text())["requests"])
]
# The first event of an answer on each API's stream.
FIRST_EVENT = {"/v1/responses": "response.created", "/v1/messages": "message_start",
               "/v1/chat/completions": "chat.completion.chunk"}
SENT_HEADERS = ("anthropic-version", "anthropic-beta", "originator", "x-app")


def _headers(recorded: dict[str, str]) -> dict[str, str]:
    headers = {k: v for k, v in recorded.items() if k in SENT_HEADERS}
    if "authorization" in recorded:
        headers["authorization"] = "Bearer placeholder-key"
    if "x-api-key" in recorded:
        headers["x-api-key"] = "placeholder-key"
    return headers


@pytest.mark.parametrize(("client", "index", "request_shape"), CASES)
def test_recorded_request_shape_is_served(base_url: str, client: str, index: int,
                                          request_shape: dict[str, Any]) -> None:
    method, path = request_shape["method"], request_shape["path"]
    headers = _headers(request_shape["headers"])
    if request_shape["body"] is None:
        r = httpx.request(method, base_url + path, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return
    body = synthesize(request_shape["body"])
    route = path.split("?")[0]
    with httpx.stream(method, base_url + path, json=body, headers=headers, timeout=120) as r:
        if r.status_code != 200:
            r.read()
        assert r.status_code == 200, f"{client} request {index}: {r.status_code} {r.text}"
        if not body.get("stream"):
            return
        # NOTE: the first event of the answer is enough: the request was accepted and the
        # model started on it; closing the stream then aborts the generation (server side).
        for line in r.iter_lines():
            if line.startswith("data:") or line.startswith("event:"):
                assert FIRST_EVENT[route] in line, line
                return
    pytest.fail(f"{client} request {index}: the stream ended with no event")
