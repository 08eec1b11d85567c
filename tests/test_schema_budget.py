"""A schema's checking is linear in its size (issue 27): places are spelt only for an error
message, and subschemas are counted against `max_schema_nodes` as they are met."""

from __future__ import annotations

import json
import tracemalloc

import httpx
import pytest

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
