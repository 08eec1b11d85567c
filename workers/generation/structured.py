"""What a request's output is held to (OpenVINO GenAI's StructuredOutputConfig), in one place:
a JSON schema, a regular expression, or, under tool_choice auto, tool calls constrained once
the model begins one (`SamplingParams.tool_tags`)."""

from __future__ import annotations

import json
import logging

import openvino_genai as ov_genai

from npu_proxy.protocol.messages import SamplingParams, ToolTags
from npu_proxy.workers.generation.json_grammar import garbled_name, schema_grammar

log = logging.getLogger(__name__)
SOC = ov_genai.StructuredOutputConfig


def structured_output(params: SamplingParams) -> ov_genai.StructuredOutputConfig | None:
    """The request's constraint, or None. Raises ValueError for a schema the worker refuses
    (the request's 400)."""
    if params.json_schema is not None:
        # NOTE: GenAI's own schema compiler lets whitespace between JSON tokens run to the
        # token limit; what json_grammar.py compiles bounds it (json_grammar.py says why).
        grammar = schema_grammar(params.json_schema)
        if grammar is None and (name := garbled_name(params.json_schema)) is not None:
            raise ValueError(f"the JSON schema's property name {json.dumps(name)[:80]} has a "
                             "quote, backslash or control character, which structured output "
                             "takes only in schemas without pattern, format, number bounds or "
                             "other keywords outside the common subset")
        return (SOC(json_schema=params.json_schema) if grammar is None
                else SOC(grammar=grammar))
    if params.regex is not None:
        return SOC(regex=params.regex)
    if params.tool_tags is not None:
        return _tool_tags(params.tool_tags)
    return None


def _tool_tags(tags: ToolTags) -> ov_genai.StructuredOutputConfig | None:
    """Free text until the model writes one of `tags.triggers`; then one of the tags (its
    begin, a value of its schema, its end); then free text again.

    NOTE: compiled by GenAI per request, and kept by it: measured with 20 tools of 3 to 8
    arguments (SmolLM2, CPU), +0.3 s to the first request with that tool set, a few ms to the
    next; a new tool set's prompt took seconds more to read. So no cache or size cut here.
    """
    out_tags = []
    for tag in tags.tags:
        content = _tag_content(tag.schema, tag.padded)
        if content is None:
            return None
        out_tags.append(SOC.Tag(tag.begin, content, tag.end))
    out = SOC()
    out.structural_tags_config = SOC.TriggeredTags(
        triggers=list(tags.triggers), tags=out_tags, at_least_one=False,
        stop_after_first=tags.single)
    return out


def _tag_content(schema: str, padded: bool) -> (
        ov_genai.StructuredOutputConfig.EBNF | ov_genai.StructuredOutputConfig.Concat
        | ov_genai.StructuredOutputConfig.JSONSchema | None):
    """What a tag holds: a value of `schema` (a newline either side if `padded`), or None
    when GenAI cannot compile the schema."""
    grammar = schema_grammar(schema, padded=padded)
    if grammar is not None:
        return SOC.EBNF(grammar)
    if garbled_name(schema) is not None:
        # NOTE: GenAI's compiler fails the whole step on such a name (json_grammar.py); the
        # client asked for no constraint, so the calls go unconstrained instead of a 400.
        log.info("tool calls left unconstrained: a tool's property name GenAI cannot compile")
        return None
    if padded:
        return SOC.Concat(SOC.Regex("\n?"), SOC.JSONSchema(schema), SOC.Regex("\n?"))
    return SOC.JSONSchema(schema)
