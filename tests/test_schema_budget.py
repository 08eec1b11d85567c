"""A schema's checking is linear in its size (issue 27): places are spelt only for an error
message, and subschemas are counted against `max_schema_nodes` as they are met."""

from __future__ import annotations

import json
import tracemalloc

import httpx
import pytest
from serverctl import Server

from npu_proxy.gateway.content.schema_check import check_schema, walk
from npu_proxy.gateway.core.errors import GatewayError

LLM = "smollm2:135m"
# The issue's input: one 256 KiB property name holding anyOf of 4,000 `true`.
NAME = "p" * (256 * 1024)
WIDE = {"type": "object", "properties": {NAME: {"anyOf": [True] * 4000}}}


def test_a_long_name_over_many_subschemas_is_checked_in_memory_linear_in_its_size() -> None:
    text = json.dumps(WIDE)
    tracemalloc.start()
    try:
        check_schema(text, max_chars=10**9)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # NOTE: with every child's place built up front this was 4,000 copies of the name: 1 GiB.
    assert peak < 8 * 1024 * 1024, peak


def test_an_error_deep_under_a_long_name_is_spelt_short() -> None:
    bad = {"type": "object", "properties": {NAME: {"anyOf": [True] * 3999 + [{"type": "x"}]}}}
    with pytest.raises(GatewayError) as err:
        check_schema(json.dumps(bad), max_chars=10**9)
    assert err.value.status == 400
    assert "/anyOf/3999/type must be one of" in err.value.message
    assert len(err.value.message) < 1000


def test_names_and_literals_are_counted_against_max_schema_chars() -> None:
    """The worker compiles every name and literal into its grammar while the other streams
    on it wait: the issue's 256 KiB name is refused before it gets there."""
    with pytest.raises(ValueError, match="pass 15000 characters"):
        walk(WIDE)
    names = {"type": "object", "properties": {f"p{i:04}": {"type": "string"} for i in range(3000)}}
    assert walk(names) == 3001  # 15,000 characters exactly
    names["properties"]["x"] = {"enum": ["y"]}
    with pytest.raises(ValueError, match="max_schema_chars"):
        walk(names)
    literals = {"type": "object", "properties": {"a": {"enum": ["e" * 14_000]},
                                                 "b": {"const": "c" * 999}}}
    with pytest.raises(ValueError, match="max_schema_chars"):
        walk(literals)


def test_the_long_name_is_a_400_naming_the_setting(base_url: str) -> None:
    r = httpx.post(base_url + "/api/chat", timeout=60, json={
        "model": LLM, "messages": [{"role": "user", "content": "hi"}], "format": WIDE,
        "stream": False})
    assert r.status_code == 400 and "max_schema_chars" in r.json()["error"], r.text[:300]


def test_nodes_are_counted_as_they_are_met() -> None:
    assert walk(WIDE, max_chars=10**9) == 4002  # the root, the property, its 4,000 alternatives
    with pytest.raises(ValueError, match="more than 4001 subschemas"):
        walk(WIDE, max_nodes=4001, max_chars=10**9)
    deep: dict[str, object] = {"type": "object"}
    for _ in range(10):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(ValueError, match="deeper than 5 levels"):
        walk(deep, max_depth=5)


def test_a_schema_over_the_node_limit_is_a_400_in_each_apis_shape(base_url: str) -> None:
    """20,001 subschemas (the default max_schema_nodes is 20,000): a 400 that names the
    setting, before anything reaches a worker."""
    big = {"type": "object", "properties": {"a": {"anyOf": [True] * 20_000}}}
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(base_url + "/v1/chat/completions", timeout=60, json={
        "model": LLM, "messages": messages, "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": big}}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "max_schema_nodes" in error["message"]
    r = httpx.post(base_url + "/api/chat", timeout=60, json={
        "model": LLM, "messages": messages, "format": big, "stream": False})
    assert r.status_code == 400 and "max_schema_nodes" in r.json()["error"]


# --- numbers the grammar compiler cannot take (issue 43) -------------------------------------

# Each of these aborted the llm worker inside its pipeline step (XGrammar's checks), with
# every stream on it; a 400 before the request reaches a worker on every API now.
NATIVE_REJECTS = [
    {"type": "integer", "minimum": 1e19},
    {"type": ["integer", "null"], "minimum": 1e19},
    {"type": "integer", "exclusiveMinimum": 9.3e18},
    {"type": "integer", "maximum": -1e19},
    {"type": "integer", "minimum": 1.5},
    {"type": "array", "maxItems": 10**19},
    {"type": "string", "maxLength": 10**19},
]


def _serving_pid(base_url: str, server: Server) -> int:
    """The llm worker's pid once it serves LLM: a request for it first, since another test
    may have switched the shared worker to another model (a switch restarts it)."""
    r = httpx.post(base_url + "/v1/chat/completions", timeout=300, json={
        "model": LLM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 200, r.text
    return int(server.children()["llm"]["pid"])


def _wrapped(sub: dict[str, object]) -> dict[str, object]:
    return {"type": "object", "properties": {"a": sub}, "required": ["a"]}


@pytest.mark.parametrize("sub", NATIVE_REJECTS, ids=json.dumps)
def test_numbers_the_grammar_compiler_cannot_take_are_refused(sub: dict[str, object]) -> None:
    with pytest.raises(GatewayError) as err:
        check_schema(json.dumps(_wrapped(sub)))
    assert err.value.status == 400 and "#/properties/a/" in err.value.message


def test_numbers_it_takes_pass() -> None:
    for sub in ({"type": "integer", "minimum": 5.0, "maximum": 2**53},
                {"type": "number", "minimum": 1e300}, {"minimum": 1e19},
                {"type": "string", "maxLength": 10**6}):
        check_schema(json.dumps(_wrapped(sub)))


def test_such_a_schema_is_a_400_on_every_api_and_the_worker_lives(
        base_url: str, server: Server) -> None:
    schema = _wrapped({"type": "integer", "minimum": 1e19})
    tool = {"type": "function", "function": {"name": "pick", "parameters": schema}}
    before = _serving_pid(base_url, server)
    hi = [{"role": "user", "content": "hi"}]
    asks = [
        ("/v1/chat/completions", {"messages": hi, "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
        ("/v1/chat/completions", {"messages": hi, "max_tokens": 4, "tools": [tool],
                                  "tool_choice": "required"}),
        ("/api/chat", {"messages": hi, "format": schema, "stream": False}),
        ("/api/generate", {"prompt": "hi", "format": schema, "stream": False}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 16, "text": {"format": {
            "type": "json_schema", "name": "x", "schema": schema}}}),
        ("/v1/messages", {"messages": hi, "max_tokens": 4, "tools": [{
            "name": "pick", "input_schema": schema}], "tool_choice": {"type": "any"}}),
    ]
    for path, body in asks:
        r = httpx.post(base_url + path, timeout=120, json={"model": LLM, **body})
        assert r.status_code == 400, (path, r.text)
        assert "minimum" in r.text, (path, r.text)
    # NOTE: under tool_choice auto the call is left unconstrained rather than refused.
    r = httpx.post(base_url + "/v1/chat/completions", timeout=120, json={
        "model": LLM, "messages": hi, "max_tokens": 4, "tools": [tool]})
    assert r.status_code == 200, r.text
    assert server.children()["llm"]["pid"] == before


# --- regexes whose automaton is too large (issue 43) -----------------------------------------


def test_a_regex_of_nested_repeats_is_refused_before_a_worker_compiles_it(
        base_url: str, server: Server) -> None:
    """19 characters, `(?:a{0,300}){0,300}`, froze every stream of the llm worker for 109 s
    (XGrammar compiles inside the step); now a 400 naming the cost, in a regex and in a
    schema's pattern, while a large flat repeat and a smaller nested one are served."""
    before = _serving_pid(base_url, server)
    hi = [{"role": "user", "content": "hi"}]
    r = httpx.post(base_url + "/v1/chat/completions", timeout=120, json={
        "model": LLM, "messages": hi, "max_tokens": 4,
        "structured_outputs": {"regex": "(?:a{0,300}){0,300}"}})
    assert r.status_code == 400 and "nested repeats" in r.json()["error"]["message"], r.text
    schema = {"type": "object", "properties": {"a": {"type": "string",
                                                     "pattern": "^(?:[ab]{0,150}){0,150}$"}}}
    r = httpx.post(base_url + "/api/chat", timeout=120, json={
        "model": LLM, "messages": hi, "format": schema, "stream": False})
    assert r.status_code == 400 and "too costly" in r.json()["error"], r.text
    for fine in ("(?:a{0,20}){0,20}", "[a-z]{0,5000}"):
        r = httpx.post(base_url + "/v1/chat/completions", timeout=120, json={
            "model": LLM, "messages": hi, "max_tokens": 4,
            "structured_outputs": {"regex": fine}})
        assert r.status_code == 200, (fine, r.text)
    assert server.children()["llm"]["pid"] == before


def test_enum_values_are_counted_against_max_schema_enum_values(base_url: str) -> None:
    """An enum of 200,000 integers compiled for 8 s inside the llm worker's step, every
    stream on it frozen (issue 43): all the enums of a schema together take at most
    max_schema_enum_values values (OpenAI's own limit, 1,000), a 400 in each API's shape."""
    split = {"type": "object", "properties": {
        "a": {"enum": list(range(600))}, "b": {"enum": [f"v{i}" for i in range(401)]}}}
    with pytest.raises(GatewayError, match="max_schema_enum_values"):
        check_schema(json.dumps(split))
    check_schema(json.dumps({"enum": list(range(1000))}))
    big = {"enum": list(range(200_000))}
    r = httpx.post(base_url + "/v1/chat/completions", timeout=60, json={
        "model": LLM, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": big}}})
    assert r.status_code == 400 and "max_schema_enum_values" in r.json()["error"]["message"]
    r = httpx.post(base_url + "/api/chat", timeout=60, json={
        "model": LLM, "stream": False, "messages": [{"role": "user", "content": "x"}],
        "format": big, "options": {"num_predict": 1}})
    assert r.status_code == 400 and "max_schema_enum_values" in r.json()["error"]
