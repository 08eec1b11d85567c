"""OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/models.

Translates the wire format to a Generate request and the worker's output back to OpenAI's
JSON bodies and SSE chunks. Decoding, dispatch, streaming and errors are the shared request
path (gateway/api/request_path.py); the error shape and SSE framing are OPENAI in
gateway/http/wire.py.
/v1/models answers in Anthropic's shape when Anthropic's SDK asks (dialect_for).

A thinking model's reasoning (gateway/content/reasoning.py) is the message's and the deltas'
`reasoning_content` and `reasoning` (vLLM's fields); vLLM's `chat_template_kwargs` reach the
chat template (`enable_thinking: false` switches thinking off, and leaves the reasoning out),
and its `structured_outputs.regex` (or `guided_regex`) constrains the output to a regex.
"""
