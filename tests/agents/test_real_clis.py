"""The real coding agents against a real daemon on the demo config (``--stress``).

Claude Code (``claude -p``) and Codex CLI (``codex exec``, a custom provider on
``wire_api = "responses"``) run as their users run them (configuration:
``docs/agents-claude-code.md``), pointed at a
:class:`~tests.support.recording_proxy.RecordingProxy` that forwards to mlxd
serving the built-in demo config, so the test sees every request and status.
Each must finish a turn with exit code 0 and no protocol error; with a tool
forced (the proxy sets ``tool_choice`` on the first request, as no CLI flag
can), the agent runs the tool and sends its result back: one round trip of its
tool loop. The forced tools have no side effects (Claude Code's ``TaskList``,
Codex's ``get_goal``).

Needs the CLIs (``npm install @anthropic-ai/claude-code @openai/codex`` in
``$MLXD_AGENTS_DIR``, default ``/work/agents-cli``; skipped without them).
Claude Code's first request is ~56,000 prompt tokens of the demo tokenizer
with ``max_tokens`` 32,000: its KV must fit (it is drawn from the budget), and its prefill takes minutes on a CPU (run
with OpenBLAS preloaded: ``LD_PRELOAD``, see ``docs/agents-claude-code.md``). Codex speaks
``POST /v1/responses`` only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from mlxd.config import Config
from tests.support.agents import Run, cli, run_claude, run_codex
from tests.support.daemon import serving
from tests.support.recording_proxy import RecordingProxy, recording

pytestmark = [pytest.mark.stress, pytest.mark.mlx]

TURN_SECONDS = 900
PROTOCOL_ERRORS = ("API Error", "stream disconnected", "unexpected status", "Invalid", "error sending request")


def _needs(name: str) -> None:
    if cli(name) is None:
        pytest.skip(f"{name} is not installed (see the module docstring)")


def _posts(proxy: RecordingProxy, path: str) -> list[dict[str, Any]]:
    return [r.json() for r in proxy.requests if r.method == "POST" and r.path.split("?")[0] == path]


#: the answer after the tool's result: one fixed word. The demo model's weights are random, so
#: its free text ends only when it happens to sample its end token (a Codex turn once ran to
#: max_output_tokens 4,096 and ended incomplete); a grammar that completes ends it.
_ONE_WORD = {"type": "string", "enum": ["done"]}
_FINISH = {
    "/v1/responses": {"text": {"format": {"type": "json_schema", "name": "done", "schema": _ONE_WORD}}},
    "/v1/messages": {"output_config": {"format": {"type": "json_schema", "schema": _ONE_WORD}}},
}


def _force_once(path: str, choice: dict[str, Any]) -> Any:
    """A proxy rewrite setting ``tool_choice`` on the first request to ``path``, and a one-word
    answer on the requests after it (the tool's result sent back)."""
    done: list[bool] = []

    def rewrite(p: str, body: Any) -> Any:
        if p.split("?")[0] != path or not isinstance(body, dict):
            return body
        if done:
            return {**body, **_FINISH[path]}
        if body.get("tools"):
            done.append(True)
            return {**body, "tool_choice": choice}
        return body

    return rewrite


def _check_run(run: Run, proxy: RecordingProxy, path: str) -> None:
    """Exit code 0, no protocol error said, and every POST to ``path`` answered 200 (Claude
    Code's ``HEAD /`` reachability probe may get mlxd's 404: it only looks for an answer)."""
    said = run.stdout + run.stderr
    assert run.returncode == 0, said[-3000:]
    assert not any(e in said for e in PROTOCOL_ERRORS), said[-3000:]
    answers = [s for m, p, s in proxy.statuses if m == "POST" and p.split("?")[0] == path]
    assert answers and all(s == 200 for s in answers), proxy.statuses


async def _agent(cfg: Config, tmp: Path, kind: str, prompt: str, *, rewrite: Any = None,
                 extra: tuple[str, ...] = ()) -> tuple[Run, RecordingProxy]:
    async with serving(cfg, tmp) as s:
        with recording(target=s.url, rewrite=rewrite, record_dir=tmp / "requests") as proxy:
            if kind == "claude":
                fn = lambda: run_claude(proxy.url, "demo", prompt, tmp / "agent",  # noqa: E731
                                        timeout=TURN_SECONDS, extra=extra)
            else:
                fn = lambda: run_codex(proxy.url + "/v1", "demo", prompt, tmp / "agent",  # noqa: E731
                                       timeout=TURN_SECONDS, extra=extra)
            run = await trio.to_thread.run_sync(fn)
    return run, proxy


async def test_claude_code_finishes_a_turn(demo: Config, tmp_path: Path) -> None:
    """claude -p against mlxd exits 0 with no protocol error, every request answered 200."""
    _needs("claude")
    run, proxy = await _agent(demo, tmp_path, "claude", "Reply with the word ok.")
    _check_run(run, proxy, "/v1/messages")
    first = _posts(proxy, "/v1/messages")[0]
    assert any(m["role"] == "system" for m in first["messages"]) and first["stream"] is True


async def test_claude_codes_tool_loop_runs_one_round_trip(demo: Config, tmp_path: Path) -> None:
    """With TaskList forced, Claude Code runs it and sends its tool_result back for the call mlxd made."""
    _needs("claude")
    force = _force_once("/v1/messages", {"type": "tool", "name": "TaskList"})
    # one built-in tool and a short system prompt: two requests of a few hundred tokens
    run, proxy = await _agent(demo, tmp_path, "claude", "List the tasks.", rewrite=force, extra=(
        "--max-turns", "3", "--tools", "TaskList", "--system-prompt", "You are a coding agent."))
    _check_run(run, proxy, "/v1/messages")
    posts = _posts(proxy, "/v1/messages")
    assert len(posts) >= 2, [p.get("tool_choice") for p in posts]
    history = posts[1]["messages"]
    calls = [b for m in history if m["role"] == "assistant" and isinstance(m["content"], list)
             for b in m["content"] if b["type"] == "tool_use"]
    results = [b for m in history if m["role"] == "user" and isinstance(m["content"], list)
               for b in m["content"] if b["type"] == "tool_result"]
    assert [c["name"] for c in calls] == ["TaskList"]
    assert [r["tool_use_id"] for r in results] == [calls[0]["id"]]


async def test_codex_finishes_a_turn(demo: Config, tmp_path: Path) -> None:
    """codex exec on a custom provider (wire_api responses) exits 0 with every request answered 200."""
    _needs("codex")
    run, proxy = await _agent(demo, tmp_path, "codex", "Reply with the word ok.")
    _check_run(run, proxy, "/v1/responses")
    assert _posts(proxy, "/v1/responses")


async def test_codex_tool_loop_runs_one_round_trip(demo: Config, tmp_path: Path) -> None:
    """With get_goal forced, Codex runs it and sends a function_call_output for the call mlxd made."""
    _needs("codex")
    force = _force_once("/v1/responses", {"type": "function", "name": "get_goal"})
    run, proxy = await _agent(demo, tmp_path, "codex", "What is the goal?", rewrite=force)
    _check_run(run, proxy, "/v1/responses")
    posts = _posts(proxy, "/v1/responses")
    assert len(posts) >= 2
    items = posts[1]["input"]
    calls = [i for i in items if i.get("type") == "function_call"]
    outputs = [i for i in items if i.get("type") == "function_call_output"]
    assert [c["name"] for c in calls] == ["get_goal"], json.dumps(items)[-2000:]
    assert [o["call_id"] for o in outputs] == [calls[0]["call_id"]]
