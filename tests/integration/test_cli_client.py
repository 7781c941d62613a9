"""`mlxd status/load/unload/events` as users run them: real CLI processes against a real `mlxd serve`.

One daemon (fake engines, an API key in its environment) serves the module;
each test works on its own models so the order of the tests does not matter.
The reconnect test runs its own daemon, which it stops and starts again.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.cli.events import parse_sse
from mlxd.cli.render import render_status
from tests.support.daemon import MLXD, REPO, DaemonProcess, fake_models_config, write_config

KEY = "s3cret-test-key"
MODELS = {"alpha": 0.3, "beta": 0.3, "gamma": 0.2, "delta": 0.2, "slow": 0.2}
LINE_TIMEOUT_S = 20.0


def client_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLXD_API_KEY"}
    return {**env, **extra}


def mlxd(*args: str, key: bool = True, env: dict[str, str] | None = None,
         timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run one `mlxd` CLI command to its end (with the daemon's key in MLXD_API_KEY if ``key``)."""
    env = env if env is not None else client_env(**({"MLXD_API_KEY": KEY} if key else {}))
    return subprocess.run([*MLXD, *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout, check=False)


def _as_in_a_terminal() -> None:
    """Ctrl-C reaches the child as it does a command run in a terminal: a suite started as a
    background job of a non-interactive shell inherits SIGINT ignored, which Python keeps
    (it installs KeyboardInterrupt only over the default disposition)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Follower:
    """`mlxd events ...` running in the background; its stdout lines arrive on a queue."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*MLXD, "events", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env if env is not None else client_env(MLXD_API_KEY=KEY), cwd=REPO,
            preexec_fn=_as_in_a_terminal,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next_line(self) -> str:
        try:
            line = self.lines.get(timeout=LINE_TIMEOUT_S)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"no event line within {LINE_TIMEOUT_S} s") from None
        if line is None:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"mlxd events ended (rc={self.proc.wait(10)}): {err}")
        return line

    def until(self, pattern: str) -> list[str]:
        """Lines up to and including the first that matches ``pattern``."""
        out = []
        while True:
            out.append(self.next_line())
            if re.search(pattern, out[-1]):
                return out

    def json_until(self, model: str, to_state: str, reason: str = "admin") -> list[dict[str, Any]]:
        """The journaled events up to that transition (live load_progress events, which
        have no id, are left out)."""
        lines = self.until(rf'"model": "{model}".*"to_state": "{to_state}", "reason": "{reason}"')
        events = [json.loads(line) for line in lines]
        assert all(e["seq"] is None for e in events if e["kind"] == "load_progress")
        return [e for e in events if e["kind"] != "load_progress"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A `mlxd serve` of fake models that requires the API key KEY."""
    tmp = tmp_path_factory.mktemp("cli")
    raw = fake_models_config(MODELS, 4.0, load_seconds=0.1)
    slow = next(m for m in raw["models"] if m["name"] == "slow")
    slow["fake"]["load_seconds"] = 1.4  # the progress line appears after 1 s
    raw["journal"] = {"path": str(tmp / "journal.db"), "synchronous": "normal"}
    with DaemonProcess(write_config(tmp / "models.yaml", raw), tmp,
                       env={"MLXD_API_KEY": KEY}) as d:
        yield d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def row_of(status_text: str, model: str) -> list[str]:
    """The status table row of ``model`` split into its columns (two or more spaces apart)."""
    for line in status_text.splitlines():
        if line.startswith(model + " "):
            return re.split(r"\s{2,}", line.strip())
    raise AssertionError(f"no row for {model} in:\n{status_text}")


def test_load_then_status_shows_loaded(daemon: DaemonProcess) -> None:
    """`mlxd load` returns once the model is loaded and says so; `mlxd status` then shows it `loaded`."""
    r = mlxd("load", "alpha", "--url", daemon.url)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"alpha loaded \(307\.2 MiB, \d+\.\d s\)\n", r.stdout)
    r = mlxd("status", "--url", daemon.url)
    assert r.returncode == 0, r.stderr
    state, pinned, memory, leases, waiters, last_used, last_error = row_of(r.stdout, "alpha")[1:]
    assert (state, pinned, memory, leases, waiters, last_error) == (
        "loaded", "no", "307.2 MiB (config)", "0", "0", "-")
    assert re.fullmatch(r"\d+s ago", last_used)
    assert re.search(r"^memory: 307\.2 MiB of 4\.00 GiB committed \(\d+%\); policy wait_then_fail",
                     r.stdout, re.M)
    assert re.search(r"^journal: healthy \(run 1, ", r.stdout, re.M)


def test_unload_then_status_shows_unloaded(daemon: DaemonProcess) -> None:
    """`mlxd unload` after a load leaves the model `unloaded` in `mlxd status`."""
    assert mlxd("load", "beta", "--url", daemon.url).returncode == 0
    assert row_of(mlxd("status", "--url", daemon.url).stdout, "beta")[1] == "loaded"
    r = mlxd("unload", "beta", "--preempt", "--url", daemon.url)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"beta unloaded \(\d+\.\d s\)\n", r.stdout)
    assert row_of(mlxd("status", "--url", daemon.url).stdout, "beta")[1] == "unloaded"


def test_status_json_is_the_admin_status(daemon: DaemonProcess) -> None:
    """`mlxd status --json` prints `/admin/status` as JSON: every model with its state, the budget."""
    r = mlxd("status", "--json", "--url", daemon.url)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert set(st["models"]) == set(MODELS)
    assert st["budget_bytes"] == 4 * 1024**3
    assert st["models"]["gamma"]["memory_source"] == "config"
    assert st["journal"]["healthy"] is True


def test_load_shows_progress_on_stderr(daemon: DaemonProcess) -> None:
    """A load that takes over a second prints `loading NAME… N s` on stderr while it waits."""
    r = mlxd("load", "slow", "--url", daemon.url)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^loading slow… 1\.\d s", r.stderr, re.M), r.stderr
    assert re.fullmatch(r"slow loaded \(204\.8 MiB, 1\.\d s\)\n", r.stdout)


def test_events_json_backlog_then_live_in_order(daemon: DaemonProcess) -> None:
    """`mlxd events --json --last-event-id 0` prints past transitions, then live ones, in order with increasing ids."""
    assert mlxd("load", "gamma", "--url", daemon.url).returncode == 0
    assert mlxd("unload", "gamma", "--url", daemon.url).returncode == 0
    follower = Follower("--json", "--last-event-id", "0", "--url", daemon.url)
    try:
        events = follower.json_until("gamma", "unloaded")
        assert mlxd("load", "gamma", "--url", daemon.url).returncode == 0
        events += follower.json_until("gamma", "loaded")
    finally:
        follower.stop()
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs)) and seqs[0] >= 1
    gamma = [(e["from_state"], e["to_state"], e["reason"]) for e in events
             if e["model"] == "gamma" and e["kind"] == "transition"]
    assert gamma == [
        ("unloaded", "loading", "admin"), ("loading", "loaded", "admin"),
        ("loaded", "unloading", "admin"), ("unloading", "unloaded", "admin"),
        ("unloaded", "loading", "admin"), ("loading", "loaded", "admin"),
    ]


def test_events_readable_lines_and_ctrl_c_exits_0(daemon: DaemonProcess) -> None:
    """`mlxd events` prints one readable line per transition, and Ctrl-C ends it with exit 0."""
    assert mlxd("load", "delta", "--url", daemon.url).returncode == 0
    follower = Follower("--last-event-id", "0", "--url", daemon.url)
    try:
        lines = follower.until(r"  delta  loading -> loaded \(admin\)")
    finally:
        follower.proc.send_signal(signal.SIGINT)
        assert follower.proc.wait(10) == 0
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}  #\d+  delta  loading -> loaded \(admin\) 204\.8 MiB",
        lines[-1],
    )
    assert any(re.search(r"#\d+  delta  unloaded -> loading \(admin\)", line) for line in lines)


def test_unknown_model_exits_1_with_one_line(daemon: DaemonProcess) -> None:
    """Loading or unloading a model the daemon does not have exits 1 with one `mlxd: ... (model_not_found)` line."""
    for command in ("load", "unload"):
        r = mlxd(command, "nope", "--url", daemon.url)
        assert r.returncode == 1
        assert r.stderr == "mlxd: The model 'nope' does not exist (model_not_found)\n"
        assert r.stdout == ""


@pytest.mark.parametrize("command", [["status"], ["load", "alpha"], ["unload", "alpha"], ["events"]])
def test_daemon_not_running_exits_3(command: list[str]) -> None:
    """Against a port nobody listens on, every client command exits 3 with one `daemon unreachable` line."""
    url = f"http://127.0.0.1:{free_port()}"
    r = mlxd(*command, "--url", url)
    assert r.returncode == 3
    assert r.stderr.startswith(f"mlxd: daemon unreachable: {url}: ")
    assert r.stderr.count("\n") == 1


def test_api_key_required(daemon: DaemonProcess) -> None:
    """With MLXD_API_KEY set in the daemon, a client without the key exits 1 with the auth message; `--api-key` succeeds."""
    r = mlxd("status", "--url", daemon.url, key=False)
    assert r.returncode == 1
    assert r.stderr == ("mlxd: the daemon wants an API key: set $MLXD_API_KEY or pass --api-key "
                        "(invalid_api_key)\n")
    r = mlxd("status", "--url", daemon.url, "--api-key", "wrong")
    assert r.returncode == 1
    assert r.stderr == "mlxd: the daemon does not know the key given with --api-key (invalid_api_key)\n"
    r = mlxd("status", "--json", "--url", daemon.url, "--api-key", KEY, key=False)
    assert r.returncode == 0, r.stderr
    assert "alpha" in json.loads(r.stdout)["models"]
    r = mlxd("events", "--url", daemon.url, key=False)
    assert r.returncode == 1 and "(invalid_api_key)" in r.stderr


def test_config_gives_url_and_key_variable(daemon: DaemonProcess, tmp_path: Path) -> None:
    """Without --url the client reads host, port and the API key variable's name from --config."""
    port = int(daemon.url.rsplit(":", 1)[1])
    raw = fake_models_config({"alpha": 0.3}, 1.0)
    raw["server"] = {"host": "0.0.0.0", "port": port, "api_key_env": "MY_MLXD_KEY"}
    config = write_config(tmp_path / "client.yaml", raw)
    r = mlxd("status", "--json", "--config", str(config), env=client_env(MY_MLXD_KEY=KEY))
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)["models"]) == set(MODELS)
    r = mlxd("status", "--config", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and r.stderr.startswith("mlxd: ")


def test_events_resume_across_a_restart_then_give_up(tmp_path: Path) -> None:
    """A follower reconnects to a restarted daemon after the last id it printed (no gap, no repeat), and exits 3 once the daemon stays away."""
    raw = fake_models_config({"a": 0.2}, 1.0, load_seconds=0.1)
    raw["journal"] = {"path": str(tmp_path / "journal.db"), "synchronous": "normal"}
    config = write_config(tmp_path / "models.yaml", raw)
    first = DaemonProcess(config, tmp_path, env={"MLXD_API_KEY": ""})
    url = first.start()
    follower = Follower("--json", "--last-event-id", "0", "--timeout", "5", "--url", url,
                        env=client_env())
    second = DaemonProcess(config, tmp_path, env={"MLXD_API_KEY": ""},
                           args=("--port", url.rsplit(":", 1)[1]))
    try:
        httpx.post(url + "/admin/models/a/load", timeout=30).raise_for_status()
        events = follower.json_until("a", "loaded")
        assert first.terminate() == 0  # the shutdown unloads a; the follower prints that
        events += follower.json_until("a", "unloaded", reason="shutdown")
        second.start()  # restore_on_start loads a again, under new ids
        events += follower.json_until("a", "loaded", reason="restore")
        second.kill()
        assert follower.proc.wait(30) == 3
        assert follower.proc.stderr is not None
        assert "gave up reconnecting" in follower.proc.stderr.read()
    finally:
        follower.stop()
        first.kill()
        second.kill()
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs))
    assert [(e["to_state"], e["reason"]) for e in events] == [
        ("loading", "admin"), ("loaded", "admin"),
        ("unloading", "shutdown"), ("unloaded", "shutdown"),
        ("loading", "restore"), ("loaded", "restore"),
    ]


def test_parse_sse_skips_comments_and_joins_data_lines() -> None:
    """The SSE reader keeps the last id, joins multi-line data and skips comments and data-less events."""
    lines = [": hello", "", "id: 7", "event: transition", "data: {\"a\":", "data: 1}", "",
             "id: 8", "", ": keepalive", "", "data: x", ""]
    messages = list(parse_sse(lines))
    assert [(m.id, m.event, m.data) for m in messages] == [
        ("7", "transition", '{"a":\n1}'), ("8", "message", "x"),
    ]
    assert [m.own_id for m in messages] == [True, False]  # "x" only inherits the last id


def test_status_table_shows_loads_waiters_and_leases() -> None:
    """`mlxd status` renders a load in progress, a draining model, its waiter and its live lease,
    and the prompt cache's disk tier."""
    def model(state: str, **kw: Any) -> dict[str, Any]:
        return {"state": state, "pinned": False, "memory_bytes": 3 * 1024**3 // 5,
                "memory_source": "measured", "active_leases": 0, "waiters": 0,
                "last_used_at": None, "last_error": None, "loading": None, **kw}

    status = {
        "version": "9.9", "uptime_s": 192.0, "budget_bytes": 1024**3,
        "committed_bytes": 6 * 1024**3 // 5, "draining": False, "load_gate": None,
        "policy": {"strategy": "wait_then_preempt", "wait_timeout_s": 30.0, "preempt_after_s": 2.0},
        "models": {
            "a": model("draining", active_leases=1, last_used_at=1000.0, pinned=True),
            "b": model("loading", waiters=1, loading={
                "seconds": 2.5, "phase": "downloading", "bytes_done": 1024**3 // 4,
                "bytes_total": 1024**3}),
        },
        "waiters": [{"model": "b", "kind": "resident", "reason": "admin", "waiting_s": 3.0,
                     "blocked": True, "deadline_in_s": 27.0}],
        "leases": [{"id": "L1", "model": "a", "request_id": "req-1",
                    "route": "/v1/chat/completions", "held_s": 75.0, "preempted": True}],
        "journal": {"enabled": True, "healthy": False, "last_error": "disk full", "run_id": 4,
                    "last_seq": 12, "committed_seq": 10, "path": "/j.db"},
        "prompt_cache_disk": {"enabled": True, "path": "/s/prompt-cache", "max_bytes": 1024**3,
                              "bytes": 48 * 1024**2, "entries": 3},
    }
    text = render_status(status, now=1042.0)
    assert text.splitlines()[:2] == [
        "mlxd 9.9, up 3m12s",
        "memory: 1.20 GiB of 1.00 GiB committed (120%); policy wait_then_preempt "
        "(preempt after 2 s, wait up to 30 s)",
    ]
    assert text.splitlines()[2] == (
        "prompt cache on disk: 48.0 MiB of 1.00 GiB (3 entries) /s/prompt-cache")
    assert row_of(text, "a")[1:] == ["draining", "yes", "614.4 MiB (measured)", "1", "0",
                                     "42s ago", "-"]
    assert row_of(text, "b")[1:4] == ["loading (2.5 s, downloading 25% of 1.00 GiB)", "no",
                                      "614.4 MiB (measured)"]
    assert "  b  resident (admin) waiting 3.0 s, blocked on memory, gives up in 27 s" in text
    assert ("  a  /v1/chat/completions  held 1m15s  request req-1  lease L1  PREEMPTED"
            in text)
    assert text.splitlines()[-1] == (
        "journal: CANNOT WRITE: disk full (run 4, committed seq 10 of 12) /j.db")
