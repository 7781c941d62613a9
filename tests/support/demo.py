"""The built-in demo config (``make serve``'s) for end-to-end tests.

:func:`demo_config` reads ``etc/models.demo.yaml`` as ``mlxd serve`` does, with
``$MLXD_STATE_DIR`` at the caller's directory (the demo models are written
there on first load, once per directory). Its models draw their KV from the
budget, so Claude Code's 56,000-token first request fits as it is.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mlxd.config import Config, parse_config
from mlxd.resources import demo_config_path


def demo_config(state: Path, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    monkeypatch.setenv("MLXD_STATE_DIR", str(state))
    raw = yaml.safe_load(demo_config_path().read_text())
    return parse_config(raw, path=tmp / "models.yaml")


#: a chat template with a thinking switch, as Qwen 3's: on, the prompt opens ``<think>``; off,
#: it holds an empty block
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}"
    "{% endif %}"
)


def write_thinking_model(path: Path) -> Path:
    """A tiny demo model whose vocabulary has ``<think>`` / ``</think>`` and whose chat template
    has the thinking switch (the tool-response markers renamed: same ids, same weights)."""
    import json

    from mlxd.engines.model_files.demo_model import write_demo_model

    write_demo_model(path, "tiny")
    tok = json.loads((path / "tokenizer.json").read_text())
    names = {"<tool_response>": "<think>", "</tool_response>": "</think>"}
    for added in tok["added_tokens"]:
        added["content"] = names.get(added["content"], added["content"])
    (path / "tokenizer.json").write_text(json.dumps(tok))
    (path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return path
