"""The prompt cache's disk tier in `mlxd serve` processes: a conversation's prefix survives a swap
and a SIGTERM restart (counted as cached, and generating a cold run's tokens), and a SIGKILL in
the middle of writing an entry leaves nothing that is ever loaded."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.daemon import DaemonProcess, write_config

#: about 360 tokens of the tiny tokenizer: written when the residency ends
SHORT = "hello world this is a tiny model for testing mlxd " * 32
#: about 1,100 tokens: written once the model has been idle 2 s
LONG = "hello world this is a tiny model for testing mlxd " * 100


def write_cfg(tiny_model: Path, tmp_path: Path, isolation: str = "thread") -> Path:
    """Models ``a`` and ``b`` (other weights) of which the budget holds one, and ``a-cold``: a's
    weights without a prompt cache (the reference a cache must not change)."""
    other = tmp_path / "tiny-b"
    shutil.copytree(tiny_model, other, dirs_exist_ok=True)
    model = {"estimated_memory_gb": 0.05, "isolation": isolation}
    raw = {
        "manager": {"memory_budget_gb": 0.1, "prompt_cache_disk_gb": 1},
        "models": [
            {"name": "a", "path": str(tiny_model), **model},
            {"name": "b", "path": str(other), **model},
            {"name": "a-cold", "path": str(tiny_model), "prompt_cache_gb": 0, **model},
        ],
    }
    return write_config(tmp_path / "models.yaml", raw)


@pytest.fixture
def cfg(tiny_model: Path, tmp_path: Path) -> Path:
    return write_cfg(tiny_model, tmp_path)


def chat(url: str, model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def next_turn(first: str, reply: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": first}, {"role": "assistant", "content": reply},
            {"role": "user", "content": "and then what happened to the quick brown fox"}]


def text(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["message"]["content"])


def check_from_disk(turn: dict[str, Any], previous_prompt: int) -> None:
    """The turn's prefix came from disk: at least 90% of the previous turn's prompt."""
    usage = turn["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.9 * previous_prompt, usage
    assert usage["mlxd_cached_tokens"] == {"memory": 0, "disk": cached}


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_prefix_survives_a_swap(tiny_model: Path, tmp_path: Path, isolation: str) -> None:
    """A evicted for B, then A again: the next turn reads its prefix from disk and generates what
    a cold run does, in the daemon or in engine processes; /admin/status shows the tier's size."""
    with DaemonProcess(write_cfg(tiny_model, tmp_path, isolation), tmp_path) as d:
        first = chat(d.url, "a", [{"role": "user", "content": SHORT}])
        assert first["usage"]["prompt_tokens"] < 1024  # so it reaches the disk at the eviction
        chat(d.url, "b", [{"role": "user", "content": "hello"}])  # evicts a: the budget holds one
        status = httpx.get(d.url + "/admin/status", timeout=10).json()
        assert status["models"]["a"]["state"] == "unloaded"
        tier = status["prompt_cache_disk"]
        assert tier["enabled"] and tier["entries"] >= 1 and 0 < tier["bytes"] <= tier["max_bytes"]
        conversation = next_turn(SHORT, text(first))
        second = chat(d.url, "a", conversation)
        check_from_disk(second, first["usage"]["prompt_tokens"])
        anthropic = httpx.post(d.url + "/v1/messages", timeout=120, json={
            "model": "a", "messages": conversation, "max_tokens": 8, "temperature": 0}).json()
        cold = chat(d.url, "a-cold", conversation)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert text(second) == text(cold)
    usage = anthropic["usage"]  # now from memory: the disk's entry joined the memory cache
    assert usage["cache_read_input_tokens"] == usage["mlxd_cached_tokens"]["memory"] > 0


def test_prefix_survives_a_sigterm_restart(cfg: Path, tmp_path: Path) -> None:
    """After SIGTERM and a new start, the next turn of a conversation reads its prefix from disk
    and generates what a cold run does."""
    d = DaemonProcess(cfg, tmp_path)
    d.start()
    try:
        first = chat(d.url, "a", [{"role": "user", "content": LONG}])
    finally:
        assert d.terminate() == 0, d.log()
    conversation = next_turn(LONG, text(first))
    with DaemonProcess(cfg, tmp_path) as again:
        second = chat(again.url, "a", conversation)
        check_from_disk(second, first["usage"]["prompt_tokens"])
        cold = chat(again.url, "a-cold", conversation)
    assert text(second) == text(cold)


def test_sigkill_mid_write_loads_no_torn_entry(cfg: Path, tmp_path: Path) -> None:
    """SIGKILL with half an entry written: the daemon starts again, the partial file is removed
    and nothing is read from disk; the turn generates what a cold run does."""
    crashing = DaemonProcess(cfg, tmp_path, env={"MLXD_CRASH_AT": "prompt_cache.mid_write"})
    crashing.start()
    try:
        chat(crashing.url, "a", [{"role": "user", "content": LONG}])
    except (httpx.HTTPError, AssertionError):
        pass  # the kill may come before the reply: the entry is written once the model has been idle 2 s
    assert crashing.proc is not None
    assert crashing.proc.wait(60) == -9, crashing.log()
    tier = tmp_path / "prompt-cache"
    torn = list(tier.rglob(".tmp-*"))
    assert torn, "the writer was not cut mid-write"
    assert not [p for p in tier.rglob("*.safetensors") if not p.name.startswith(".tmp-")]

    conversation = next_turn(LONG, "fine")
    with DaemonProcess(cfg, tmp_path) as again:
        second = chat(again.url, "a", conversation)
        assert not [p for p in torn if p.exists()]  # the load's scan removed it
        assert second["usage"]["mlxd_cached_tokens"] == {"memory": 0, "disk": 0}
        cold = chat(again.url, "a-cold", conversation)
    assert text(second) == text(cold)
