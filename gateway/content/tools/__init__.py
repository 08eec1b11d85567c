"""Tool calling for every API, in one package: definitions (and each API's wire form:
dialects), prompting, forcing and parsing.

Each dialect turns its wire format into the internal form here (`Tool`, `ToolChoice`,
`ToolCall`) and back; what happens in between is the same for OpenAI, Ollama and Anthropic.

How tools reach the model:
- A chat template that knows tools (its Jinja source mentions `tools`, e.g. Qwen2.5, Llama 3.x)
  gets them natively: `Generate.tools` in the Hugging Face format and assistant `tool_calls` /
  `tool` messages passed through to `apply_chat_template`.
- Otherwise (SmolLM2's template has no tools slot) the fallback prompt: a `# Tools` section
  appended to the system message lists each tool as `{"name", "description", "parameters"}`
  JSON inside `<tools></tools>` and asks for a call as one JSON object
  `{"name": ..., "arguments": {...}}` inside `<tool_call></tool_call>` tags (the Hermes/Qwen
  convention small models have seen most). Earlier calls in the history are written back the
  same way, and tool results become a user turn of `<tool_response>` JSON blocks (tool roles
  are unknown to such templates).

tool_choice:
- `none`: tools are not offered and the output is not parsed (history still rendered).
- `auto`: tools are offered and the output is parsed: if it is a call, it is a call, else text.
  A call once begun, with its markers (`<tool_call>`: the fallback prompt, Hermes/Qwen
  templates) or as bare JSON (`{"name"`), is constrained to one offered tool and its schema
  (`SamplingParams.tool_tags`, `auto_call_schema`); nothing forces the model to begin one.
- `required` (OpenAI) / `any` (Anthropic) / a named function: generation is constrained
  (structured output, `SamplingParams.json_schema`) to `{"name": const, "arguments": <that
  tool's parameters schema>}` (`anyOf` over the tools; with parallel calls allowed and no
  named function, a JSON array of them), so even a 135M model returns a call whose arguments
  validate. A call cut short by max_tokens is not a call: the text comes back, finish `length`.
- Ollama has no tool_choice: tools given means `auto`; the extension option
  `options.tool_choice` ("auto", "none", "required" or a function name) forces a call the same
  way (real Ollama ignores unknown options, so clients may send it to either server).

Parsing (`CallParser`, the project's own; OpenVINO GenAI's parsers run inside the worker and
are bound to one model family each): the output is a call when, after leading whitespace, it
is JSON (bare, in a code fence, or after Mistral's `[TOOL_CALLS]`) or when a `<tool_call>` tag
(or a `<tools>` wrapper, as the template lists tools) appears anywhere; the JSON may be one
object, several, or an array, each
`{"name", "arguments"|"parameters"}` (also OpenAI-style `{"function": {...}}`, arguments as an
object or a JSON string; `{"function": "<name>", "arguments"}` too; a Python dict such as
`{'name': ..., 'arguments': {...}}` is read as the JSON it means, pyliteral.py) naming an
offered tool, in a code fence or inline code or bare;
bare calls the output begins with are calls and any text after them stays text; so is a call
begun `{"name"` after text, bare or fenced (the tool grammar holds it to the schema under
tool_choice auto). A call written as an XML element, `<function name="<name>"
arguments='{...}'>` or Llama 3.1's `<function=<name>>{...}</function>`, is a call wherever it
stands (parsed, not constrained; streamed, held from its head on). Anything else is text.
Streaming and non-streaming responses use the same parser, so they agree: a stream holds
what may be a call only until it is known to be none (its JSON value or tag closed around no
call, its fence opened on no value; streaming.py).
"""

from npu_proxy.gateway.content.json_size import ToolBudget
from npu_proxy.gateway.content.tools.definitions import (
    CUSTOM_INPUT,
    MAX_PARALLEL,
    Mode,
    Tool,
    ToolCall,
    ToolChoice,
    ToolRequest,
    history_call,
    loads_arguments,
)
from npu_proxy.gateway.content.tools.dialects import (
    anthropic_choice,
    anthropic_tools,
    ollama_choice,
    openai_choice,
    openai_tools,
    responses_choice,
    responses_tools,
)
from npu_proxy.gateway.content.tools.forcing import call_schema
from npu_proxy.gateway.content.tools.parsing import TAG_CLOSE, TAG_OPEN, parse_calls
from npu_proxy.gateway.content.tools.prompting import PreparedChat, prepare, prepare_chat
from npu_proxy.gateway.content.tools.streaming import CallParser, fragments, split_calls

__all__ = [
    "CUSTOM_INPUT", "MAX_PARALLEL", "TAG_CLOSE", "TAG_OPEN", "CallParser", "Mode", "PreparedChat",
    "Tool", "ToolBudget", "ToolCall", "ToolChoice", "ToolRequest", "anthropic_choice",
    "anthropic_tools", "call_schema", "fragments", "history_call", "loads_arguments",
    "ollama_choice", "openai_choice", "openai_tools", "parse_calls", "prepare", "prepare_chat",
    "responses_choice", "responses_tools", "split_calls",
]
