"""Structured output has bounded whitespace between the JSON's tokens, in every dialect.

GenAI's own schema compiler let SmolLM2-135M answer "Invent a person" with
`{\\n\\n"name"\\n\\n:\\n\\n"name"\\n\\n,\\n\\n"age"\\n\\n:\\n\\n\\n\\n\\n…` until max_tokens;
workers/generation/json_grammar.py compiles the schema to a grammar whose whitespace is
llama.cpp's. Only what the grammar forces is asserted: JSON that parses, matches the schema
and has no run of more than two newlines or of 20 spaces outside its strings.
"""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest
from serverctl import Server

from npu_proxy.workers.generation.json_grammar import integer_range, schema_grammar

LLM = "smollm2:135m"
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ASK = "Invent a person"
# temperature, seed
SAMPLING = [(0.0, None), (1.0, 2)]
STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')


def assert_tidy(text: str, schema: dict[str, Any], stopped: bool = True) -> None:
    """No long runs of whitespace outside strings; parsed and valid against `schema` when the
    reply ended by itself."""
    outside = STRINGS.sub('""', text)
    # NOTE: what the grammar forces (json_grammar.WS): at most two newlines, then at most 20
    # spaces or tabs; a deep tree may use all 20 (seen on an AMX CPU).
    assert "\n\n\n" not in outside and " " * 21 not in outside, repr(text)
    if stopped:
        jsonschema.validate(json.loads(text), schema)


def ended(finish: str | None, temperature: float) -> bool:
    """Whether the reply ended by itself. NOTE: a sampled string may run to max_tokens (the
    grammar does not bound it); the greedy reply is deterministic and must end: on GenAI's own
    compiler it ran to the limit in whitespace."""
    if temperature == 0:
        assert finish == "stop"
    return finish == "stop"


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)


@pytest.mark.parametrize(("temperature", "seed"), SAMPLING)
def test_openai_response_format(oai: openai.OpenAI, temperature: float,
                                seed: int | None) -> None:
    reply = oai.chat.completions.create(
        model=LLM, messages=[{"role": "user", "content": ASK}], max_tokens=60,
        temperature=temperature, seed=seed,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}})
    choice = reply.choices[0]
    assert_tidy(choice.message.content or "", PERSON,
                ended(choice.finish_reason, temperature))


@pytest.mark.parametrize(("temperature", "seed"), SAMPLING)
def test_ollama_format(server: Server, temperature: float, seed: int | None) -> None:
    client = ollama.Client(host=server.url, timeout=120)
    options: dict[str, Any] = {"temperature": temperature, "num_predict": 60}
    if seed is not None:
        options["seed"] = seed
    reply = client.chat(model=LLM, messages=[{"role": "user", "content": ASK}],
                        format=PERSON, options=options)
    assert_tidy(reply.message.content or "", PERSON, ended(reply.done_reason, temperature))


def test_responses_text_format(oai: openai.OpenAI) -> None:
    reply = oai.responses.create(
        model=LLM, input=ASK, max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    assert_tidy(reply.output_text, PERSON)


def test_anthropic_output_config(server: Server) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=120)
    msg = claude.messages.create(
        model=LLM, max_tokens=60, extra_body={"temperature": 0},
        output_config={"format": {"type": "json_schema", "schema": PERSON}},
        messages=[{"role": "user", "content": ASK}])
    assert_tidy(msg.content[0].text, PERSON)  # type: ignore[union-attr]


# Schemas of every construct the compiler takes, each compiled by the worker's GenAI: a
# grammar it could not compile would fail the step and every request on the worker.
SHAPES: list[dict[str, Any]] = [
    {"type": "object"},
    {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": -5, "maximum": 123},
        "e": {"enum": ["x", "é", 3, None]},
        "t": {"$ref": "#/$defs/tree"}},
     "$defs": {"tree": {"type": "array", "items": {"$ref": "#/$defs/tree"}, "maxItems": 2}}},
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                 "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"}, "x": {"type": ["number", "null"]},
        "k": {"const": {"a": [1, 'q"\\']}}},
     "required": ["tags", "ok", "x", "k"], "additionalProperties": False},
    {"type": "object", "properties": {
        "w\"ei rd\\": {"type": "string", "minLength": 1, "maxLength": 3},
        "😀": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 3},
        "p": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}],
              "title": "P", "default": None}},
     "required": ["w\"ei rd\\", "😀", "p"]},
]


@pytest.mark.parametrize("schema", SHAPES)
def test_compiled_shapes_run(http: httpx.Client, schema: dict[str, Any]) -> None:
    assert schema_grammar(json.dumps(schema)) is not None
    body = {"model": LLM, "messages": [{"role": "user", "content": "Some JSON please."}],
            "max_tokens": 80, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema}}}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    # NOTE: a string may run to max_tokens (not forced): validated only when it stopped.
    assert_tidy(choice["message"]["content"], schema, stopped=choice["finish_reason"] == "stop")


def test_the_rest_is_left_to_genai(http: httpx.Client) -> None:
    """A keyword outside the compiled subset keeps GenAI's own compiler, as before."""
    schema = {"type": "object", "properties": {"code": {"type": "string",
                                                        "pattern": "^[a-z]{2,4}$"}},
              "required": ["code"]}
    assert schema_grammar(json.dumps(schema)) is None
    body = {"model": LLM, "messages": [{"role": "user", "content": "A code please."}],
            "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema}}}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("schema", [
    {"type": "string", "format": "date"},
    {"type": "number", "minimum": 0},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}},
    {"type": "array", "prefixItems": [{"type": "string"}]},
    {"allOf": [{"type": "string"}, {"maxLength": 3}]},
    {"$ref": "https://example.com/s.json"},
    # NOTE: left recursion (a $ref back to itself before any character) is not compilable.
    {"$ref": "#/$defs/a", "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}},
    {"type": "integer", "minimum": 10 ** 30},
])
def test_unsupported_schemas_fall_back(schema: dict[str, Any]) -> None:
    assert schema_grammar(json.dumps(schema)) is None


@pytest.mark.parametrize(("low", "high"), [
    (0, 100), (-5, 123), (None, 7), (3, None), (-100, -3), (17, 4321), (0, 0), (10, 10),
    (-9, 9), (99, 1001)])
def test_integer_ranges_are_exact(low: int | None, high: int | None) -> None:
    # NOTE: the EBNF alternatives read as Python regexes once quotes and spaces go.
    alternatives = [a.replace('"', "").replace(" ", "") for a in integer_range(low, high)]
    exact = re.compile("(?:" + "|".join(alternatives) + ")")
    for n in range(-2000, 20000):
        inside = (low is None or n >= low) and (high is None or n <= high)
        assert bool(exact.fullmatch(str(n))) == inside, n
    assert not exact.fullmatch("007") and not exact.fullmatch("-0")


def test_names_genai_would_garble_are_refused(http: httpx.Client) -> None:
    """A property name with a quote, outside the compiled subset, is a 400 (GenAI's own
    compiler failed the worker on it: 503 worker_lost) and the worker serves on."""
    schema = {"type": "object", "properties": {'say "hi"': {"type": "string",
                                                            "format": "email"}},
              "required": ['say "hi"']}
    body: dict[str, Any] = {
        "model": LLM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "temperature": 0, "response_format": {"type": "json_schema",
                                              "json_schema": {"name": "s", "schema": schema}}}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert "property name" in resp.json()["error"]["message"]
    del body["response_format"]
    assert http.post("/v1/chat/completions", json=body).status_code == 200
