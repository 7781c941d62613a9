"""The prompt-limit rules: a model's context from its config.json, the cap, the length bound."""

from __future__ import annotations

import pytest

from mlxd.config import ModelConfig
from mlxd.engines.base import ChatMessage, GenerationRequest
from mlxd.engines.text.prompt_limits import (
    DEFAULT_MAX_PROMPT_TOKENS,
    check_prompt_chars,
    context_from_config,
    fit_prompt_tokens,
    limits_of,
)
from mlxd.errors import ContextLengthExceeded
from mlxd.http.bodyscan import body_prompt_chars, facts


@pytest.mark.parametrize(
    ("cfg", "context"),
    [
        ({"max_position_embeddings": 4096}, 4096),
        ({"n_positions": 1024}, 1024),
        ({"text_config": {"max_position_embeddings": 8192}}, 8192),
        # YaRN on top of the stated length (Qwen's recipe) multiplies it
        ({"max_position_embeddings": 32768,
          "rope_scaling": {"type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": 32768}}, 131072),
        # llama3-style scaling already states the scaled length
        ({"max_position_embeddings": 131072,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                           "original_max_position_embeddings": 8192}}, 131072),
        ({"hidden_size": 64}, None),
        ({"max_position_embeddings": True}, None),
    ],
)
def test_context_from_config(cfg: dict[str, object], context: int | None) -> None:
    """The context is the stated length (or its equivalents), times a YaRN factor that extends it."""
    assert context_from_config(cfg) == context


def test_the_cap_is_the_smaller_of_the_configured_cap_and_the_context() -> None:
    """max_prompt_tokens caps the prompt below the context; without either, the default cap applies."""
    m = ModelConfig(name="m", source="/x")
    assert limits_of(m, None).max_prompt_tokens == DEFAULT_MAX_PROMPT_TOKENS
    assert limits_of(m, 4096).max_prompt_tokens == 4096
    capped = ModelConfig(name="m", source="/x", max_prompt_tokens=100)
    assert limits_of(capped, 4096).max_prompt_tokens == 100
    assert limits_of(capped, 50).max_prompt_tokens == 50


def test_checks_name_the_field() -> None:
    """Over the cap names the prompt; max_tokens past the context's room is lowered to it; a prompt filling the context is refused naming the prompt."""
    limits = limits_of(ModelConfig(name="m", source="/x"), 64)
    chat = GenerationRequest(kind="chat", messages=(ChatMessage("user", "x" * 1025),), max_tokens=4)
    with pytest.raises(ContextLengthExceeded) as e:
        check_prompt_chars("m", chat, limits)
    assert e.value.param == "messages" and e.value.code == "context_length_exceeded"
    req = GenerationRequest(kind="completion", prompt="p", max_tokens=60)
    assert fit_prompt_tokens("m", req, 4, limits) == 60
    assert fit_prompt_tokens("m", req, 5, limits) == 59
    assert fit_prompt_tokens("m", req, 63, limits) == 1
    with pytest.raises(ContextLengthExceeded) as e:
        fit_prompt_tokens("m", req, 64, limits)
    assert e.value.param == "prompt"


def test_body_facts_count_the_same_characters_as_the_validated_request() -> None:
    """The child process's count of a raw body equals prompt_chars of the validated request."""
    from mlxd.engines.text.prompt_limits import prompt_chars

    body = {"model": "m", "messages": [
        {"role": "user", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "abc"},
                                      {"type": "image_url", "image_url": {"url": "x"}}]}]}
    req = GenerationRequest(kind="chat", messages=(
        ChatMessage("user", "hello"), ChatMessage("user", [{"type": "text", "text": "abc"}])))
    assert body_prompt_chars(body) == prompt_chars(req) == 8
    assert body_prompt_chars({"prompt": ["abcd"]}) == 4
    assert facts(b'{"model": "m", "prompt": "xyz"}') == {"model": "m", "prompt_chars": 3}
    assert "error" in facts(b'{"model": ')
