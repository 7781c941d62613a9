"""Ollama's request fields into engine requests, thinking split from content, and model file facts."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from mlxd.engines.base import Finished
from mlxd.engines.model_files.model_facts import file_facts, parameter_size
from mlxd.errors import InvalidRequest, ModelNotFound
from mlxd.http.ollama_render import OllamaRenderer, ThinkingSplit
from mlxd.http.ollama_shapes import DEFAULT_NUM_PREDICT, OllamaRequest, model_name, parse

KNOWN = {"tiny", "llava", "org/x:7b"}


def req(body: dict[str, Any], kind: str = "chat", headers: dict[str, str] | None = None) -> OllamaRequest:
    return parse({"model": "tiny", **body}, kind, known=KNOWN.__contains__,  # type: ignore[arg-type]
                 allow_images=lambda n: n == "llava", request_id="r1", headers=headers or {})


def test_model_names_take_latest_and_nothing_else() -> None:
    """``name:latest`` is the configured ``name``; other tags and unknown names are 404s; a configured
    name with its own tag is itself."""
    assert model_name("tiny:latest", KNOWN.__contains__) == "tiny"
    assert model_name("org/x:7b", KNOWN.__contains__) == "org/x:7b"
    for unknown in ("tiny:7b", "nope", "nope:latest", "TINY"):
        with pytest.raises(ModelNotFound):
            model_name(unknown, KNOWN.__contains__)


def test_options_map_onto_sampling_and_unknown_ones_are_ignored() -> None:
    """temperature, top_p, top_k, seed, num_predict and stop map; top_k 1 and top_p 0 are greedy;
    num_predict 0 or negative is the default; unknown options are ignored."""
    gen = req({"messages": [{"role": "user", "content": "hi"}],
               "options": {"temperature": 0.7, "top_p": 0.9, "seed": -1, "num_predict": 33,
                           "stop": "END", "mirostat": 2, "num_gpu": 99}}).generation
    assert (gen.temperature, gen.top_p, gen.seed, gen.max_tokens, gen.stop) == (0.7, 0.9, 2**32 - 1, 33, ("END",))
    assert req({"messages": [], "options": {"top_k": 40}}).generation.top_k == 40
    greedy = req({"messages": [{"role": "user", "content": "hi"}], "options": {"top_k": 1, "num_predict": -1}})
    assert greedy.generation.temperature == 0.0 and greedy.generation.max_tokens == DEFAULT_NUM_PREDICT
    assert req({"messages": [], "options": {"top_p": 0}}).generation.temperature == 0.0


def test_the_load_call_streams_and_keep_alive() -> None:
    """No messages (chat) or no prompt (generate) is the load call; streaming is the default; keep_alive
    takes Ollama's durations."""
    load = req({"keep_alive": "1h30m"})
    assert load.load_call and load.stream and load.prefs.keep_alive_s == 5400
    assert req({"prompt": ""}, "generate").load_call
    assert not req({"prompt": "x", "stream": False}, "generate").load_call
    assert req({"messages": [], "keep_alive": -5}).prefs.keep_alive_s == -1


def test_tool_messages_answer_the_calls_they_name() -> None:
    """An assistant's calls get ids; a tool message answers the call its tool_name names, else the
    first one unanswered; arguments are objects."""
    calls = [{"function": {"name": "a", "arguments": {"x": 1}}}, {"function": {"name": "b", "arguments": {}}}]
    gen = req({"messages": [{"role": "user", "content": "q"},
                            {"role": "assistant", "content": "", "tool_calls": calls},
                            {"role": "tool", "content": "B", "tool_name": "b"},
                            {"role": "tool", "content": "A"}]}).generation
    assistant, answer_b, answer_a = gen.messages[1:]
    assert [json.loads(c.arguments) for c in assistant.tool_calls] == [{"x": 1}, {}]
    assert answer_b.tool_call_id == assistant.tool_calls[1].id and answer_b.name == "b"
    assert answer_a.tool_call_id == assistant.tool_calls[0].id and answer_a.name == "a"


def test_images_raw_and_refused_generate_fields() -> None:
    """Images become data URL parts on vision models only; raw sends the prompt without the template;
    template, suffix and context are refused naming the field."""
    gen = req({"model": "llava", "prompt": "what?", "images": ["iVBORw0KGgo="]}, "generate").generation
    (user,) = gen.messages
    assert isinstance(user.content, list)
    assert user.content[1]["image_url"]["url"].startswith("data:image/png;base64,iVBOR")
    with pytest.raises(InvalidRequest, match="images"):
        req({"prompt": "what?", "images": ["iVBORw0KGgo="]}, "generate")
    raw = req({"prompt": "<s>hi", "raw": True}, "generate").generation
    assert (raw.kind, raw.prompt, raw.messages) == ("completion", "<s>hi", ())
    for field, value in (("template", "{{ .Prompt }}"), ("suffix", "x"), ("context", [1])):
        with pytest.raises(InvalidRequest, match=field):
            req({"prompt": "x", field: value}, "generate")


def test_format_and_forced_tool_calls_become_constraints() -> None:
    """format json / a schema are grammar constraints; options.tool_choice forces a call; both at
    once is a 400 naming format."""
    assert req({"messages": [], "format": "json"}).generation.constraint.kind == "json_object"  # type: ignore[union-attr]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    c = req({"messages": [], "format": schema}).generation.constraint
    assert c is not None and json.loads(c.schema) == schema
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    forced = req({"messages": [], "tools": tools, "options": {"tool_choice": "required"}}).generation
    assert forced.constraint is not None and forced.constraint.kind == "tool_call"
    with pytest.raises(InvalidRequest, match="format"):
        req({"messages": [], "tools": tools, "format": "json", "options": {"tool_choice": "required"}})


def test_every_field_is_checked_before_an_unknown_models_404() -> None:
    """A bad field of a body naming an unknown model is its 400; a good body is the model's 404."""
    with pytest.raises(InvalidRequest, match=r"options\.temperature"):
        req({"model": "nope", "options": {"temperature": "hot"}})
    with pytest.raises(ModelNotFound):
        req({"model": "nope", "messages": []})


@pytest.mark.parametrize("chunks", [["<think>why</think>because"], ["<thi", "nk>wh", "y</th", "ink>bec", "ause"],
                                    list("<think>why</think>because")])
def test_thinking_is_split_from_content_across_deltas(chunks: list[str]) -> None:
    """Text between the markers is thinking, the rest content, however the deltas cut the markers."""
    split = ThinkingSplit("<think>", "</think>")
    thinking, content = "", ""
    for chunk in chunks:
        t, c = split.feed(chunk)
        thinking, content = thinking + t, content + c
    t, c = split.flush()
    assert (thinking + t, content + c) == ("why", "because")


def test_counters_are_nanoseconds_in_order() -> None:
    """The last line's counters: total = load + prompt eval + eval, in nanoseconds."""
    r = OllamaRenderer("tiny", "chat", t0=100.0)
    r.lease_at, r.first_at = 101.0, 101.5
    counters = r.counters(Finished("stop", 7, 3, started_at=101.25), end=103.0)
    assert counters == {"total_duration": 3_000_000_000, "load_duration": 1_000_000_000,
                        "prompt_eval_count": 7, "prompt_eval_duration": 250_000_000,
                        "eval_count": 3, "eval_duration": 1_500_000_000}


def _safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    header = {name: {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]} for name, (dtype, shape) in tensors.items()}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_file_facts_count_parameters_and_name_quantization(tmp_path: Path) -> None:
    """Parameters come from the safetensors headers (packed 4-bit weights unpacked, their scales and
    biases not counted); family, quantization and context from config.json."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 64, "max_position_embeddings": 4096,
        "quantization": {"bits": 4, "group_size": 64}}))
    _safetensors(tmp_path / "model.safetensors", {
        "layer.weight": ("U32", [64, 8]), "layer.scales": ("F16", [64, 1]),
        "layer.biases": ("F16", [64, 1]), "norm.weight": ("F16", [64])})
    facts = file_facts(tmp_path)
    assert (facts.family, facts.parameter_count, facts.quantization) == ("qwen2", 64 * 64 + 64, "Q4")
    assert (facts.context_length, facts.embedding_length) == (4096, 64)
    assert parameter_size(7_615_616_512) == "7.6B" and parameter_size(25_300_000) == "25.3M"
