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
