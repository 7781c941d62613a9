"""The real coding-agent CLIs, driven against a local server (test support and re-recording).

Claude Code (npm ``@anthropic-ai/claude-code``) and Codex CLI (npm
``@openai/codex``) are looked up in ``$MLXD_AGENTS_DIR/node_modules/.bin``
(default ``/work/agents-cli``; ``npm install @anthropic-ai/claude-code
@openai/codex`` there), then on ``PATH``. Each runs with a home directory of its
own (nothing of the user's configuration is read or written) and the
configuration ``docs/agents-claude-code.md`` documents.

Re-recording the fixtures (``tests/fixtures/agents/``)::

    python -m tests.support.agents record

points each CLI at a :class:`~tests.support.recording_proxy.RecordingProxy`
answering a canned error, keeps the first request's body, scrubs what names the
machine, the session or the user (:func:`scrub`), and writes
``claude_code_first_request.json`` and ``codex_first_request.json``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.recording_proxy import recording

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "agents"
AGENTS_DIR = Path(os.environ.get("MLXD_AGENTS_DIR", "/work/agents-cli"))
WORKDIR_NAME = "project"  # the agents' working directory, under their private home


def cli(name: str) -> str | None:
    """The path of the ``claude`` or ``codex`` executable, or None when not installed."""
    local = AGENTS_DIR / "node_modules" / ".bin" / name
    return str(local) if local.exists() else shutil.which(name)


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str


def _home(root: Path) -> tuple[Path, Path]:
    home = root / "home"
    work = home / WORKDIR_NAME
    work.mkdir(parents=True, exist_ok=True)
    return home, work


def _base_env(home: Path) -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TMPDIR", "TERM")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(HOME=str(home), USER="agent", LOGNAME="agent", NO_COLOR="1", CI="1")
    return env


def claude_env(base_url: str, model: str, home: Path) -> dict[str, str]:
    """Claude Code's environment for a local Messages server (``base_url`` without ``/v1``)."""
    env = _base_env(home)
    env.update(
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY="local",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_TELEMETRY="1",
        ANTHROPIC_DEFAULT_HAIKU_MODEL=model,
        ANTHROPIC_DEFAULT_SONNET_MODEL=model,
        ANTHROPIC_DEFAULT_OPUS_MODEL=model,
        ANTHROPIC_SMALL_FAST_MODEL=model,
        API_TIMEOUT_MS="3600000",  # a long prompt's prefill on a CPU takes minutes
    )
    return env


def run_claude(base_url: str, model: str, prompt: str, root: Path, *, timeout: float,
               extra: tuple[str, ...] = ()) -> Run:
    """``claude -p PROMPT --model MODEL --max-turns 1`` against ``base_url``."""
    exe = cli("claude")
    if exe is None:
        raise FileNotFoundError("claude is not installed (npm install @anthropic-ai/claude-code)")
    home, work = _home(root)
    p = subprocess.run(
        [exe, "-p", prompt, "--model", model, "--max-turns", "1", *extra],
        cwd=work, env=claude_env(base_url, model, home), capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL, check=False,
    )
    return Run(p.returncode, p.stdout, p.stderr)


def codex_config(base_url: str, model: str) -> str:
    """Codex CLI's ``config.toml`` for a local Responses server (``base_url`` ends in ``/v1``)."""
    return (
        f'model = "{model}"\n'
        'model_provider = "mlxd"\n'
        'approval_policy = "never"\n'
        'sandbox_mode = "read-only"\n'
        "\n[model_providers.mlxd]\n"
        'name = "mlxd"\n'
        f'base_url = "{base_url}"\n'
        'env_key = "MLXD_API_KEY"\n'
        'wire_api = "responses"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
    )


def run_codex(base_url: str, model: str, prompt: str, root: Path, *, timeout: float,
              extra: tuple[str, ...] = ()) -> Run:
    """``codex exec --skip-git-repo-check PROMPT`` with a custom provider at ``base_url``."""
    exe = cli("codex")
    if exe is None:
        raise FileNotFoundError("codex is not installed (npm install @openai/codex)")
    home, work = _home(root)
    codex_home = home / ".codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(codex_config(base_url, model))
    env = _base_env(home)
    env.update(CODEX_HOME=str(codex_home), MLXD_API_KEY="local")
    p = subprocess.run(
        [exe, "exec", "--skip-git-repo-check", *extra, prompt],
        cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL, check=False,
    )
    return Run(p.returncode, p.stdout, p.stderr)


UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def scrub(body: Any, root: Path) -> Any:
    """``body`` with session ids, uuids, dates, the private home and the machine's name replaced."""
    text = json.dumps(body)
    work = str(root / "home" / WORKDIR_NAME)
    for path, name in ((work, "/home/user/project"), (work.replace("/", "-"), "-home-user-project"),
                       (str(root / "home"), "/home/user"), (str(root), "/tmp/agent")):
        text = text.replace(path, name)
    text = UUID.sub("00000000-0000-4000-8000-000000000000", text)
    text = DATE.sub("2026-01-01", text)
    host = os.uname().nodename
    if host:
        text = text.replace(host, "host")
    out = json.loads(text)
    if isinstance(out, dict):
        meta = out.get("metadata")
        if isinstance(meta, dict) and "user_id" in meta:
            meta["user_id"] = "user_0000"
        for key in ("prompt_cache_key",):
            if key in out:
                out[key] = "00000000-0000-4000-8000-000000000000"
    return out


REFUSAL = {"type": "error", "error": {"type": "invalid_request_error", "message": "recording proxy: request kept"}}


def record_first(kind: str, prompt: str, timeout: float = 120) -> dict[str, Any]:
    """The first model request ``kind`` ("claude" or "codex") sends, scrubbed."""
    with tempfile.TemporaryDirectory(prefix="agent-") as tmp, recording(status=400, body=REFUSAL) as proxy:
        root = Path(tmp)
        try:
            if kind == "claude":
                run_claude(proxy.url, "demo", prompt, root, timeout=timeout)
            else:
                run_codex(proxy.url + "/v1", "demo", prompt, root, timeout=timeout)
        except subprocess.TimeoutExpired:
            pass  # the request is what we came for; a CLI still retrying is stopped
        wanted = "/v1/messages" if kind == "claude" else "/v1/responses"
        for rec in proxy.requests:
            if rec.method == "POST" and rec.path.split("?")[0] == wanted:
                return scrub(rec.json(), root)  # type: ignore[no-any-return]
        seen = [f"{r.method} {r.path}" for r in proxy.requests]
        raise RuntimeError(f"{kind} sent no POST {wanted} (saw {seen})")


def fixture(name: str) -> dict[str, Any]:
    """A recorded first request (``claude_code`` or ``codex``)."""
    return json.loads((FIXTURES / f"{name}_first_request.json").read_text())  # type: ignore[no-any-return]


def trimmed(body: dict[str, Any], *, tools: int = 3, chars: int = 300) -> dict[str, Any]:
    """``body`` with the same shape (every field, every message and block kind, the
    system-role message, ``cache_control``) but its first ``tools`` tools and each text cut
    to ``chars``: the recorded request at a size the default suite prefills in seconds."""

    def cut(v: Any) -> Any:
        if isinstance(v, str):
            return v[:chars]
        if isinstance(v, list):
            return [cut(x) for x in v]
        if isinstance(v, dict):
            return {k: (cut(x) if k in ("text", "content", "description", "instructions") else x)
                    for k, x in v.items()}
        return v

    out = {k: (cut(v) if k in ("system", "messages", "input", "instructions") else v)
           for k, v in body.items()}
    if "tools" in out:
        out["tools"] = [cut(t) for t in body["tools"][:tools]]
    return out


PROMPT = "Reply with the word ok."


def main(argv: list[str]) -> int:
    if argv[:1] != ["record"]:
        print("usage: python -m tests.support.agents record", file=sys.stderr)
        return 2
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for kind, name in (("claude", "claude_code_first_request.json"), ("codex", "codex_first_request.json")):
        body = record_first(kind, PROMPT)
        (FIXTURES / name).write_text(json.dumps(body, indent=1, ensure_ascii=False) + "\n")
        print(f"{name}: {len(json.dumps(body))} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
