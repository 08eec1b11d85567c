"""One request's derived work is bounded by the limits, not by its body (issue 27): tools are
measured only up to `max_prompt_chars`, a forced call copies no tool schema, and a request
that would grow past the workers' socket limit is refused at the gateway, never sent.

Each test counts work (items looked at, copies made) or watches what another request sees;
none measures time.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from errors import error_message
from serverctl import HELD, Server, held_faults, small_llm

from npu_proxy.gateway.content.json_size import ToolBudget, measure
from npu_proxy.gateway.content.tools import Tool, ToolChoice, ToolRequest, call_schema
from npu_proxy.gateway.core.errors import GatewayError

LLM = "smollm2:135m"
HI = [{"role": "user", "content": "hi"}]


class CountingList(list[Any]):
    """A list that counts the items handed out by iterating it."""

    def __init__(self, items: list[Any]) -> None:
        super().__init__(items)
        self.seen = 0

    def __iter__(self) -> Iterator[Any]:
        for item in super().__iter__():
            self.seen += 1
            yield item


def test_measuring_stops_once_the_limit_is_passed() -> None:
    enum = CountingList([1e15 + i for i in range(400_000)])
    schema = {"type": "object", "properties": {"n": {"enum": enum}}}
    size = measure(schema, "tools[0]", limit=1000)
    assert size > 1000
    # NOTE: every item adds at least a character and a separator: past 1,000 characters
    # after at most 500 items, whatever the list holds.
    assert enum.seen <= 500
    enum.seen = 0
    assert measure(schema, "tools[0]") > 400_000 * 18
    assert enum.seen == 400_000


def test_the_tools_share_one_budget() -> None:
    budget = ToolBudget(10_000)
    budget.charge({"type": "object", "properties": {"a": {"type": "string"}}}, "tools[0]")
    enum = CountingList(list(range(1_000_000)))
    with pytest.raises(GatewayError) as refused:
        budget.charge({"enum": enum}, "tools[1]")
    assert refused.value.status == 400 and refused.value.kind == "context_length_exceeded"
    assert "max_prompt_chars" in refused.value.message and refused.value.param == "tools"
    assert enum.seen <= 5_000


class Counted(dict[str, Any]):
    """A schema node that counts its deep copies."""

    copies = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> Counted:
        Counted.copies += 1
        return Counted(self)


def test_a_forced_call_copies_no_tool_schema() -> None:
    tools = [Tool(f"f{i}", "", {"type": "object", "properties": {
        f"p{j}": Counted(type="string", description="d" * 20) for j in range(20)}})
        for i in range(200)]
    Counted.copies = 0
    schema = call_schema(ToolRequest(tools, ToolChoice("required")))
    assert schema is not None and Counted.copies == 0
    variants = json.loads(schema)["items"]["anyOf"]
    assert [v["properties"]["name"]["const"] for v in variants] == [t.name for t in tools]
    assert variants[7]["properties"]["arguments"] == tools[7].parameters
    # A tool's own definitions still move to the root, its refs renamed.
    own = Tool("g", "", {"type": "object", "$defs": {"P": {"type": "integer"}},
                         "properties": {"p": {"$ref": "#/$defs/P"}}})
    out = json.loads(call_schema(ToolRequest([own], ToolChoice("required", "g"))) or "")
    assert out["$defs"] == {"t0_P": {"type": "integer"}}
    assert out["properties"]["arguments"]["properties"]["p"] == {"$ref": "#/$defs/t0_P"}


# A placeholder for 100,000 numbers written `1e15` (Python's json writes 1000000000000000.0).
ENUM = ["@ENUM@"]
JSON = {"content-type": "application/json"}


def _body(value: Any) -> bytes:
    return json.dumps(value).replace('["@ENUM@"]', "[" + ",".join(["1e15"] * 100_000) + "]") \
        .encode()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/v1/messages",
                                  "/v1/responses"])
def test_tools_past_the_prompt_limit_are_a_400(base_url: str, path: str) -> None:
    # NOTE: 100,000 numbers of 4 characters each, 2 MB of tool text (1e15 is written
    # 1000000000000000.0): past max_prompt_chars (1,000,000) in a 500 KB body.
    params = {"type": "object", "properties": {"n": {"enum": ENUM}}}
    fn = {"name": "f", "description": "d", "parameters": params}
    tools: Any = ([{"name": "f", "input_schema": params}] if path == "/v1/messages" else
                  [{"type": "function", **fn}] if path == "/v1/responses" else
                  [{"type": "function", "function": fn}])
    r = httpx.post(base_url + path, timeout=60, headers=JSON, content=_body({
        "model": LLM, "max_tokens": 1, "stream": False, "tools": tools, "input": "hi",
        "messages": HI}))
    assert r.status_code == 400, r.text
    assert "max_prompt_chars" in error_message(r)


# --- the workers' socket limit, checked at the sender ----------------------------------------

BODY_LIMIT = 512 * 1024


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Bodies up to 512 KiB, so a worker takes messages up to 2 MiB (2 * max_body_bytes +
    1 MiB); prompts up to 8 M characters and enums of any size, so the tools below pass that
    socket limit while within every limit of the request itself. Its worker holds a request
    whose id starts with HELD (serverctl.held_faults) until the test opens its gate.

    NOTE: the small model (serverctl.small_llm): what is seen is status codes and whether a
    stream ends whole, never its text."""
    tmp = tmp_path_factory.mktemp("budget")
    srv = Server(tmp, workers=[{"name": "llm", "role": "llm", "faults": held_faults(tmp)}],
                 max_body_bytes=BODY_LIMIT, max_prompt_chars=8_000_000,
                 max_schema_enum_values=1_000_000, models=small_llm()).start()
    yield srv
    srv.stop()


VICTIM = HELD + "budget-victim"


def _stream(url: str, accepted: threading.Event, out: dict[str, Any]) -> None:
    """A stream the worker accepted (its headers came) and holds until the test opens its
    gate: in flight on the worker's link while the test sends what must not reach it."""
    body = {"model": LLM, "messages": HI, "stream": True, "max_tokens": 24,
            "ignore_eos": True, "temperature": 0}
    chunks = 0
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=180,
                          headers={"X-Request-ID": VICTIM}) as r:
            out["status"] = r.status_code
            accepted.set()
            for line in r.iter_lines():
                # NOTE: text chunks only: a held stream also sends keep-alives.
                if line.startswith("data: {") and any(
                        c["delta"].get("content") for c in json.loads(line[6:])["choices"]):
                    chunks += 1
                elif line == "data: [DONE]":
                    out["done"] = True
        out["chunks"] = chunks
    finally:
        accepted.set()


def test_a_request_past_the_workers_socket_limit_is_refused_at_the_gateway(
        small: Server) -> None:
    # NOTE: 100,000 numbers of 4 characters (a 500 KB body) become 2 MB of tool text, twice
    # over with tool_choice "required" (the offered tools and the forced call's schema).
    params = {"type": "object", "properties": {"n": {"enum": ENUM}}}
    hostile = {"model": LLM, "max_tokens": 1, "messages": HI, "tool_choice": "required",
               "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]}
    data = _body(hostile)
    assert len(data) < BODY_LIMIT
    accepted, out = threading.Event(), dict[str, Any]()
    victim = threading.Thread(target=_stream, args=(small.url, accepted, out))
    victim.start()
    try:
        assert accepted.wait(180) and out.get("status") == 200, out
        _refused(small.url, data, hostile)
        assert "done" not in out, out  # still held, so in flight through the refusals
    finally:
        (small.gates / VICTIM).touch()  # NOTE: also on a failure, or the join waits 180 s
    victim.join(180)
    # The held stream, released after the refusals, is served whole on the same link.
    assert out == {"status": 200, "done": True, "chunks": out["chunks"]} and out["chunks"] > 1
    # The link to the worker still carries requests (a dropped connection loses them).
    r = httpx.post(small.url + "/v1/chat/completions", timeout=120, json={
        "model": LLM, "messages": HI, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert small.children()["llm"]["restarts"] == 0


def _refused(url: str, data: bytes, hostile: dict[str, Any]) -> None:
    r = httpx.post(url + "/v1/chat/completions", content=data, timeout=60, headers=JSON)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    assert "2 * max_body_bytes + 1 MiB" in r.json()["error"]["message"]
    # The same request as an Ollama chat: its own shape.
    r = httpx.post(url + "/api/chat", timeout=60, headers=JSON, content=_body({
        "model": LLM, "stream": False, "messages": HI, "tools": hostile["tools"],
        "options": {"num_predict": 1, "tool_choice": "required"}}))
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"], r.text
