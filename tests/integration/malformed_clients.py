"""The real-client fields of the malformed-body suite (test_malformed.py): tools, structured
output and logprobs on chat, and the Anthropic Messages and embeddings routes."""

from __future__ import annotations

from typing import Any

MODEL = "alpha-text"
MISSING = object()  # a mutation that removes the field

_FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
#: chat-only fields of the real clients (tools, structured output, logprobs); the daemon's
#: models are fakes, so even well-formed tools and grammars get a 400 naming the field
CHAT_MUTATIONS: dict[str, list[Any]] = {
    "tools": [1, "x", {}, [1], [{"type": "x"}], [{"type": "function"}],
              [{"type": "function", "function": {"name": ""}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
              [{"type": "function", "function": {"name": "f", "parameters": []}}],
              [{"type": "function", "function": {"name": "f", "description": 3}}],
              [_FN, _FN], [_FN] * 200, [_FN]],
    "tool_choice": ["sometimes", 1, True, [], {"type": "function"}, "required",
                    {"type": "function", "function": {"name": "nope"}}],
    "response_format": [1, "json", [], {}, {"type": "xml"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}},
                        {"type": "json_schema", "json_schema": {"name": "x y", "schema": {}}},
                        {"type": "json_schema",
                         "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
                        {"type": "json_object"}],
    "logprobs": ["yes", 1, [], {}],
    "top_logprobs": [21, -1, "3", 1.5, 5],
    "parallel_tool_calls": ["yes", 1, []],
}
COMPLETION_MUTATIONS: dict[str, list[Any]] = {
    "logprobs": [6, -1, True, "2", 1.5, []],
    "tools": [[_FN]],
    "response_format": [{"type": "json_object"}],
}


EMBEDDINGS = "/v1/embeddings"
EMBEDDINGS_BODY: dict[str, Any] = {"model": MODEL, "input": "hi"}
#: the daemon's models are fakes (no embedding model): a well-formed body names the model
EMBEDDINGS_MUTATIONS: dict[str, list[Any]] = {
    "model": [MISSING, None, 1, "", MODEL],
    "input": [MISSING, None, 1, "", [], [""], [1, "a"], [[1], "a"], [[-1]], [[]], [None], {},
              ["x"] * 2049],
    "encoding_format": ["hex", 1, []],
    "dimensions": [0, -1, "8", 1.5, True],
}
MESSAGES = "/v1/messages"
MESSAGES_BODY: dict[str, Any] = {"model": MODEL, "max_tokens": 4,
                                 "messages": [{"role": "user", "content": "hi"}]}
#: Anthropic fields -> wrong values; each answer is Anthropic's envelope naming the field
MESSAGES_MUTATIONS: dict[str, list[Any]] = {
    "model": [MISSING, None, 1, "", [MODEL]],
    "max_tokens": [MISSING, None, 0, -1, "4", 1.5, True, 10**9],
    "messages": [MISSING, None, [], "hi", [1], [{"role": "system", "content": "x"}],
                 [{"role": "user"}], [{"role": "user", "content": []}],
                 [{"role": "user", "content": [{"type": "hologram"}]}],
                 [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                 [{"role": "user", "content": [{"type": "text"}]}],
                 [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
                 [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
                 [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": ""}]}]],
    "system": [1, [1], [{"type": "image"}]],
    "stop_sequences": ["x", [1], [""], ["a"] * 17],
    "temperature": [-1, 1.5, "0"],
    "top_p": [2, "x"],
    "top_k": [-1, 1.5, "3"],
    "stream": ["yes", 1],
    "metadata": ["x", 1],
    "tools": [1, [1], [{"name": "f"}], [{"name": "f", "input_schema": {"type": "string"}}],
              [{"name": "f", "input_schema": {"type": "nonsense"}}], [{"type": "web_search", "name": "w"}],
              [{"name": "f", "input_schema": {"type": "object"}}]],
    "tool_choice": [1, "auto", {"type": "whatever"}, {"type": "any"}, {"type": "tool", "name": "f"}],
}


RESPONSES = "/v1/responses"
RESPONSES_BODY: dict[str, Any] = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
#: Responses API fields -> wrong values; each is a 400 whose param names the field (the models
#: are fakes: function tools and text.format grammars too)
RESPONSES_MUTATIONS: dict[str, list[Any]] = {
    "model": [MISSING, None, 1, "", [MODEL], "x" * 300],
    "input": [MISSING, None, 1, True, {}, [1], ["hi"], [None], [{}], [{"type": "hologram"}],
              [{"role": "wizard", "content": "x"}], [{"role": "user"}],
              [{"role": "user", "content": 1}], [{"role": "user", "content": [1]}],
              [{"role": "user", "content": [{"type": "input_audio"}]}],
              [{"role": "user", "content": [{"type": "input_text"}]}],
              [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}],
              [{"role": "system", "content": [{"type": "refusal", "refusal": "no"}]}],
              [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}],
              [{"type": "function_call", "call_id": "c", "name": "f g", "arguments": "{}"}],
              [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}],
              [{"type": "function_call", "call_id": "c", "name": "f",
                "arguments": "[" * 100_000 + "]" * 100_000}],
              [{"type": "function_call_output", "call_id": "c"}],
              [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}],
              [{"type": "item_reference", "id": "msg_1"}], [{"type": "message"}],
              [{"role": "user", "content": "x"}] * 10_001],
    "instructions": [1, [], {}],
    "previous_response_id": [1, "", "r" * 200, [], "resp_missing"],
    "max_output_tokens": [0, -1, "4", 1.5, True, 10**9, []],
    "temperature": [-1, 2.5, "0", True, float("nan")],
    "top_p": [-0.1, 1.5, "x"],
    "seed": [2**70, "1", 1.5, True],
    "stream": ["yes", 1, []],
    "store": ["yes", 0, []],
    "tools": [1, "x", {}, [1], [{}], [{"type": 1}], [{"type": "function"}],
              [{"type": "function", "name": "f", "parameters": {"type": "string"}}],
              [{"type": "function", "name": "f", "strict": "yes"}],
              [{"type": "function", "name": "f"}] * 2, [{"type": "web_search"}] * 200,
              [{"type": "function", "name": "f"}]],
    "tool_choice": ["sometimes", 1, True, [], {}, {"type": 3}, "required",
                    {"type": "function", "name": "nope"}, {"type": "web_search_preview"},
                    {"type": "file_search"}, {"type": "mcp", "server_label": "x"},
                    {"type": "custom", "name": "apply_patch"},
                    {"type": "allowed_tools", "mode": "sometimes", "tools": []},
                    {"type": "allowed_tools", "mode": "required", "tools": []}],
    "text": [1, "json", [], {"format": 1}, {"format": {"type": "xml"}},
             {"format": {"type": "json_schema"}}, {"format": {"type": "json_schema", "name": "x"}},
             {"format": {"type": "json_schema", "name": "x", "schema": 3}},
             {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}},
             {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": "yes"}},
             {"verbosity": "loud"}, {"format": {"type": "json_object"}}],
    "include": ["x", [1], {}],
    "top_logprobs": [21, -1, "3", 5],
    "metadata": ["x", 1, [], {"k": 1}, {"k": "v" * 600}, {f"k{i}": "v" for i in range(17)}],
    "reasoning": ["high", 1, {"effort": "max"}, {"summary": 1}],
    "truncation": ["sometimes", 1],
    "parallel_tool_calls": ["yes", 1],
    "max_tool_calls": [0, "1", 1.5],
    "background": [True, "yes", 1],
    "prompt": [{"id": "pmpt_1"}, "x"],
    "conversation": ["conv_1", {"id": "conv_1"}],
    "user": [1, []],
    "stream_options": ["x", 1],
}
