"""The OpenAI Responses API (/v1/responses) through the official `openai` SDK (strict response
validation) and the `openai-agents` SDK, against the shared server and SmolLM2-135M.

What a 135M model says is not asserted, only the structure a client sees: a forced
tool_choice constrains its output to a valid call, a JSON schema to valid JSON, and
temperature 0 keeps each request deterministic.
"""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import Field

from npu_proxy.gateway.api.responses.reply import ResponseReply
from npu_proxy.gateway.api.responses.store import ResponseStore
from npu_proxy.gateway.core.errors import GatewayError
from npu_proxy.protocol.messages import Accepted, ChatMessage, Delta

LLM = "smollm2:135m"
ASK = "What is the weather in Paris?"
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    # NOTE: lengths bounded, so any greedy decode is a short object (issue 28).
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather",
                     "description": "Get the current weather in a city",
                     "parameters": WEATHER_SCHEMA, "strict": True}]


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                         _strict_response_validation=True)


def _text(resp: Any) -> str:
    (item,) = [o for o in resp.output if o.type == "message"]
    return "".join(part.text for part in item.content)


def test_create_with_text(client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.create(
        model=LLM, input="What is the capital of France?", instructions="Answer briefly.",
        temperature=0, max_output_tokens=24, metadata={"k": "v"}, user="u1")
    resp = raw.parse()
    assert raw.headers["x-npu-proxy-device"] == "CPU"
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status in ("completed", "incomplete") and resp.error is None
    assert resp.model == LLM and resp.instructions == "Answer briefly."
    assert resp.metadata == {"k": "v"} and resp.user == "u1" and resp.store is True
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert resp.output_text == _text(resp) and resp.output_text.strip()
    usage = resp.usage
    assert usage is not None
    assert usage.input_tokens == int(raw.headers["x-npu-proxy-token-count"])
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert resp.tool_choice == "auto" and resp.tools == [] and resp.parallel_tool_calls


def test_input_items_and_reasoning_accepted(client: openai.OpenAI) -> None:
    resp = client.responses.create(
        model=LLM, temperature=0, max_output_tokens=8, store=False,
        reasoning={"effort": "low"},
        input=[{"role": "developer", "content": "Be brief."},
               {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
               {"role": "user", "content": "Name a colour."}])
    assert resp.store is False and resp.reasoning is not None
    assert resp.reasoning.effort == "low"
    assert resp.output[0].type == "message"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)  # store: false keeps nothing


def test_json_schema_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "age": {"type": "integer", "minimum": 0,
                                                       "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    resp = client.responses.create(
        model=LLM, input="Invent a person.", temperature=0, max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                         "strict": True}})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)
    fmt = resp.text.format  # type: ignore[union-attr]
    assert fmt is not None and fmt.type == "json_schema" and fmt.name == "person"
    loose = client.responses.create(model=LLM, input="Any JSON.", temperature=0,
                                    max_output_tokens=32, text={"format": {"type": "json_object"}})
    assert loose.text.format.type == "json_object"  # type: ignore[union-attr]
    # NOTE: a generic object may run past max_output_tokens; constrained, it starts as one.
    assert loose.output_text.lstrip().startswith("{")


def test_function_tool_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=LLM, input=ASK, tools=TOOLS, temperature=0, max_output_tokens=64,
        tool_choice={"type": "function", "name": "get_weather"})
    assert first.status == "completed"
    calls = [o for o in first.output if o.type == "function_call"]
    (call,) = calls
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id and call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    assert first.tool_choice.type == "function"  # type: ignore[union-attr]
    assert first.tools[0].type == "function" and first.tools[0].name == "get_weather"
    # Stateless: the whole history goes back, the call and its output as items.
    history: Any = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": call.call_id,
                     "output": "Sunny, 22 degrees"}]
    second = client.responses.create(model=LLM, input=history, tools=TOOLS,
                                     tool_choice="none", temperature=0, max_output_tokens=24)
    assert [o.type for o in second.output] == ["message"]
    asked = client.responses.create(model=LLM, input=ASK, tools=TOOLS, tool_choice="none",
                                    temperature=0, max_output_tokens=1, store=False)
    assert second.usage is not None and asked.usage is not None
    assert second.usage.input_tokens > asked.usage.input_tokens  # the call and its output
    required = client.responses.create(model=LLM, input=ASK, tools=TOOLS, temperature=0,
                                       tool_choice="required", max_output_tokens=96)
    assert required.output[-1].type == "function_call"


def test_stream_events_in_order(client: openai.OpenAI) -> None:
    with client.responses.stream(model=LLM, input="What is the capital of France?",
                                 temperature=0, max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert squeezed == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    item_id = final.output[0].id
    assert {e.item_id for e in deltas} == {item_id}  # type: ignore[union-attr]
    text = "".join(e.delta for e in deltas)
    done = next(e for e in events if e.type == "response.output_text.done")
    assert text == done.text == final.output_text  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens > 0
    assert client.responses.retrieve(final.id).output_text == text


def test_stream_function_call_events(client: openai.OpenAI) -> None:
    with client.responses.stream(model=LLM, input=ASK, tools=TOOLS, temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert squeezed == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    arguments = "".join(e.delta for e in events  # type: ignore[union-attr]
                        if e.type == "response.function_call_arguments.delta")
    (call,) = final.output
    assert call.type == "function_call" and call.arguments == arguments
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)


def test_max_output_tokens_is_incomplete(client: openai.OpenAI, base_url: str) -> None:
    resp = client.responses.create(model=LLM, input="Tell me a long story.", temperature=0,
                                   max_output_tokens=3)
    assert resp.status == "incomplete" and resp.usage is not None
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.output[0].status == "incomplete"  # type: ignore[union-attr]
    body = {"model": LLM, "input": "Tell me a long story.", "max_output_tokens": 3,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", base_url + "/v1/responses", json=body, timeout=60) as r:
        names = [ln[7:] for ln in r.iter_lines() if ln.startswith("event: ")]
    assert names[-1] == "response.incomplete" and "response.completed" not in names


def test_previous_response_id_continues(client: openai.OpenAI) -> None:
    first = client.responses.create(model=LLM, input="My name is Ada.", temperature=0,
                                    max_output_tokens=16)
    alone = client.responses.create(model=LLM, input="What is my name?", temperature=0,
                                    max_output_tokens=16, store=False)
    second = client.responses.create(model=LLM, input="What is my name?", temperature=0,
                                     max_output_tokens=16, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert first.usage is not None and alone.usage is not None and second.usage is not None
    # The first exchange (its input and its output) is part of the second's prompt.
    assert second.usage.input_tokens >= alone.usage.input_tokens + \
        first.usage.output_tokens + 4
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=LLM, input="x", previous_response_id="resp_nope")
    assert info.value.code == "previous_response_not_found"


def test_previous_response_id_with_a_function_call_output(client: openai.OpenAI) -> None:
    """The stateful tool loop: only the call's output is sent, the call comes from the store."""
    first = client.responses.create(model=LLM, input=ASK, tools=TOOLS, temperature=0,
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=64)
    (call,) = [o for o in first.output if o.type == "function_call"]
    second = client.responses.create(
        model=LLM, previous_response_id=first.id, tools=TOOLS, tool_choice="none",
        temperature=0, max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 22 degrees"}])
    assert [o.type for o in second.output] == ["message"]
    stateless = client.responses.create(
        model=LLM, tools=TOOLS, tool_choice="none", temperature=0, max_output_tokens=16,
        store=False, input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
                            {"type": "function_call_output", "call_id": call.call_id,
                             "output": "Sunny, 22 degrees"}])
    assert second.usage is not None and stateless.usage is not None
    assert second.usage.input_tokens == stateless.usage.input_tokens  # the same prompt
    assert second.output_text == stateless.output_text


def test_retrieve_and_delete(client: openai.OpenAI, base_url: str) -> None:
    resp = client.responses.create(model=LLM, input="Hello", temperature=0,
                                   max_output_tokens=8)
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text
    client.responses.delete(resp.id)
    for call in (lambda: client.responses.retrieve(resp.id),
                 lambda: client.responses.delete(resp.id)):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        body = info.value.body
        assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=LLM, input="x", previous_response_id=resp.id)


def test_image_input_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=LLM, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    assert "does not support images" in info.value.message


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b'{"model": "smollm2:135m"}', "input"),
    (b'{"model": "smollm2:135m", "input": []}', "input"),
    (b'{"model": "smollm2:135m", "input": 5}', "input"),
    (b'{"model": "smollm2:135m", "input": [5]}', "input"),
    (b'{"model": "smollm2:135m", "input": [{"type": "nope"}]}', "input"),
    (b'{"model": "smollm2:135m", "input": [{"role": "robot", "content": "x"}]}', "input"),
    (b'{"model": "smollm2:135m", "input": [{"role": "user", "content": 3}]}', "input"),
    (b'{"model": "smollm2:135m", "input": [{"type": "function_call"}]}', "input"),
    (b'{"model": "smollm2:135m", "input": "x", "max_output_tokens": 0}', "max_output_tokens"),
    (b'{"model": "smollm2:135m", "input": "x", "temperature": 9}', "temperature"),
    (b'{"model": "smollm2:135m", "input": "x", "tools": [1]}', "tools"),
    (b'{"model": "smollm2:135m", "input": "x", "tools": [{"type": "function"}]}', "tools"),
    (b'{"model": "smollm2:135m", "input": "x", "tool_choice": "required"}', "tool_choice"),
    (b'{"model": "smollm2:135m", "input": "x", "tool_choice": {"type": "web_search"}}',
     "tool_choice"),
    (b'{"model": "smollm2:135m", "input": "x", "text": {"format": {"type": "yaml"}}}', "text"),
    (b'{"model": "smollm2:135m", "input": "x", "reasoning": {"effort": "max"}}', "reasoning"),
    (b'{"model": "smollm2:135m", "input": "x", "background": true}', "background"),
    (b'{"model": "smollm2:135m", "input": "x", "metadata": {"k": 1}}', "metadata"),
])
def test_bad_input_is_400_in_openai_shape(base_url: str, body: bytes,
                                          param: str | None) -> None:
    r = httpx.post(base_url + "/v1/responses", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    # NOTE: a wrong type names its place (input[0], tools[0]); a wrong value its field.
    assert error["param"] == param or error["param"].startswith(param + "[")


def test_item_and_tool_limits(base_url: str) -> None:
    """The chat limits hold for input items and tools, counted as sent (defaults: 10,000
    messages, 256 tools)."""
    items = [{"type": "reasoning", "summary": []}] * 10_001 + [{"role": "user", "content": "x"}]
    r = httpx.post(base_url + "/v1/responses", json={"model": LLM, "input": items}, timeout=30)
    assert r.status_code == 400 and "max_messages" in r.json()["error"]["message"]
    tools = [{"type": "function", "name": f"t{i}"} for i in range(257)]
    r = httpx.post(base_url + "/v1/responses", json={"model": LLM, "input": "x", "tools": tools},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_agents_sdk_runs_a_function_tool(base_url: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    set_tracing_disabled(True)
    seen: list[str] = []

    # NOTE: every turn is bounded by what the grammar forces, not by the model's choice: one
    # call (parallel_tool_calls off), a city of at most 40 characters, and after the tool's
    # output an answer from an enum (output_type). Under parallel calls SmolLM2 on an AMD
    # EPYC repeated the same call in the forced array until max_tokens, which the Agents SDK
    # raises as an error (status incomplete); on an AMX CPU it had written one.
    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=40)]) -> str:
        """The current weather in a city."""
        seen.append(city)
        return f"Sunny in {city}"

    async def run() -> tuple[Any, Any, Any]:
        oai = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
        model = OpenAIResponsesModel(model=LLM, openai_client=oai)
        agent = Agent(name="weather", instructions="Use the tool.", model=model,
                      tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                   parallel_tool_calls=False, max_tokens=64))
        result = await Runner.run(agent, ASK)
        streamed = Runner.run_streamed(agent, ASK)
        async for _ in streamed.stream_events():
            pass
        # The whole loop: the call is forced, its output goes back as a function_call_output
        # item, and the next turn (tool_choice reset to auto) answers in the output_type.
        looped = await Runner.run(agent.clone(tool_use_behavior="run_llm_again",
                                              output_type=Literal["sunny", "rainy"]),
                                  ASK, max_turns=4)
        await oai.close()
        return result, streamed, looped

    result, streamed, looped = asyncio.run(run())
    assert len(seen) >= 3 and all(isinstance(city, str) for city in seen)
    assert result.final_output == f"Sunny in {seen[0]}"
    assert streamed.final_output == f"Sunny in {seen[1]}"
    assert looped.final_output in ("sunny", "rainy")
    # The looped agent's requests carry a response format (its output_type) beside the
    # forced call: the call wins (as on OpenAI), and the turn after the tool's output
    # (tool_choice reset to auto) ran on the function_call_output item the server took.
    kinds = [type(item).__name__ for item in looped.new_items]
    assert kinds[0] == "ToolCallItem" and "ToolCallOutputItem" in kinds
    assert len(looped.raw_responses) >= 2


# --- the store, without the server ----------------------------------------------------------


def test_store_bounds_count_bytes_and_age() -> None:
    clock = [0.0]
    store = ResponseStore(max_count=2, ttl=10.0, max_bytes=10_000, clock=lambda: clock[0])
    said = [ChatMessage(role="user", content="hi")]
    for name in ("a", "b", "c"):
        assert store.put(name, {"id": name}, said)
    assert store.get("a") is None and store.get("b") and store.get("c")  # the oldest went
    clock[0] = 9.0
    assert store.put("d", {"id": "d"}, said)
    clock[0] = 10.5
    assert store.get("b") is None and store.get("c") is None and store.get("d")
    assert not store.put("big", {"id": "x" * 20_000}, said)  # larger than the whole store
    small = ResponseStore(max_count=100, ttl=10.0, max_bytes=1000, clock=lambda: clock[0])
    for name in ("e", "f", "g"):
        assert small.put(name, {"id": name * 20}, said)
    assert len(small) < 3 and small.get("g")
    assert store.delete("d") and not store.delete("d")
    assert not ResponseStore(0, 10.0, 100).put("x", {}, said)


def test_store_byte_cap_bounds_the_memory_it_holds() -> None:
    """An echoed schema of empty objects: 2 bytes of JSON each, ~50 bytes each decoded."""
    cap = 1_000_000
    def schema() -> dict[str, Any]:  # NOTE: built anew per response, as each is decoded
        return {"type": "object", "properties": {f"p{i}": {} for i in range(20_000)}}

    said = [ChatMessage(role="user", content="hi")]
    store = ResponseStore(max_count=10_000, ttl=60.0, max_bytes=cap)
    tracemalloc.start()
    try:
        for i in range(40):
            body = {"id": f"r{i}", "text": {"format": {"type": "json_schema", "schema": schema()}}}
            store.put(f"r{i}", body, said)
            del body
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 0 < len(store) < 40
    assert held < 2 * cap, f"{held:,} bytes held under a cap of {cap:,}"
    kept = store.get("r39")
    assert kept is not None and kept.body["text"]["format"]["schema"] == schema()
    assert kept.history == said


def test_raw_stream_names_each_event_after_its_type(base_url: str) -> None:
    body = {"model": LLM, "input": "Hi", "max_output_tokens": 4, "stream": True,
            "store": False}
    with httpx.stream("POST", base_url + "/v1/responses", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    datas = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert len(names) == len(datas) == len(lines) // 2
    assert names == [d["type"] for d in datas]  # and no [DONE] line
    assert datas[0]["response"]["status"] == "in_progress"
    assert datas[0]["response"]["usage"] is None


# --- a failure mid-stream, without the server ------------------------------------------------


class _LostWorker:
    """What a Generation looks like to a reply when its worker dies after one delta."""

    def __init__(self) -> None:
        self.accepted = Accepted(id="r", seq=0, worker="llm", device="CPU", prompt_tokens=5)
        self.finished = None
        self.tokens = 1

    async def __aiter__(self) -> AsyncIterator[Delta]:
        yield Delta(id="r", seq=1, text="Hel", tokens=1)
        raise GatewayError(503, "worker_lost", "worker llm exited")


def test_worker_lost_mid_stream_is_response_failed() -> None:
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    store = ResponseStore(10, 60.0, 10_000)
    reply = ResponseReply({"model": LLM, "tools": [], "tool_choice": "auto",
                           "parallel_tool_calls": True}, None, store, [])

    async def collect() -> list[dict[str, Any]]:
        return [e async for e in reply.events(_LostWorker())]  # type: ignore[arg-type]

    events = asyncio.run(collect())
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.failed"]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    failed = parsed[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.code == "server_error" and "exited" in failed.error.message
    assert failed.output[0].status == "incomplete"  # type: ignore[union-attr]
    assert store.get(reply.id) is None  # a failed response is not kept


ODD_VALUES: list[Any] = [None, -1, 1.5, "x", "\u0000", [], [None], {}, True, 10**20, [{}],
                         {"type": 1}]
ITEMS: list[dict[str, Any]] = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
]
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}


def test_fuzz_items_and_tools(base_url: str) -> None:
    """Each field of an input item, a tool and the nested settings takes odd values: never a
    5xx, every refusal in OpenAI's error shape."""
    base = {"model": LLM, "max_output_tokens": 1, "store": False}
    bodies = [{**base, "input": [{**item, key: v}, {"role": "user", "content": "x"}]}
              for item in ITEMS for key in item for v in ODD_VALUES]
    bodies += [{**base, "input": "x", "tools": [{**TOOL, key: v}]}
               for key in TOOL for v in ODD_VALUES]
    for v in ODD_VALUES:
        bodies += [{**base, "input": "x", "tools": [TOOL], "tool_choice": v},
                   {**base, "input": "x", "text": {"format": v}},
                   {**base, "input": "x", "reasoning": v},
                   {**base, "input": "x", "previous_response_id": v},
                   {**base, "input": [{"role": "user", "content": [v]}]}]
    failures = []
    with httpx.Client(base_url=base_url, timeout=120) as http:
        for body in bodies:
            r = http.post("/v1/responses", json=body)
            if r.status_code >= 500 or (r.status_code >= 400 and set(r.json()["error"]) != {
                    "message", "type", "param", "code"}):
                failures.append(f"{body}: {r.status_code} {r.text[:200]}")
    assert not failures, "\n".join(failures)
