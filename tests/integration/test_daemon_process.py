"""The daemon as users run it: `mlxd serve` in its own process, signals, exit codes, the demo config."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.daemon import MLXD, REPO, DaemonProcess, fake_models_config, write_config


def stream_until_end(url: str, model: str, results: list[str], started: threading.Barrier,
                     max_tokens: int = 100_000) -> None:
    """Read one SSE stream to its end; record how it ended: 'done', 'error:<code>' or 'cut'."""
    payload = {"model": model, "messages": [{"role": "user", "content": "go"}],
               "max_tokens": max_tokens, "stream": True}
    last = None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=payload, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if last is None:
                        started.wait(30)
                    last = line[6:]
    except httpx.HTTPError:
        results.append("cut")
        return
    if last == "[DONE]":
        results.append("done")
    elif last is not None and last.startswith("{") and "error" in json.loads(last):
        results.append("error:" + json.loads(last)["error"]["code"])
    else:
        results.append("cut")


def wait_until_draining(url: str, timeout: float = 30.0) -> None:
    """Wait until /health answers 503 shutting_down (what operators poll; no event crosses processes)."""
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "the daemon never started its graceful shutdown"


def test_sigterm_with_ten_live_streams_exits_cleanly(tmp_path: Path) -> None:
    """SIGTERM with 10 live streams: exit 0 within shutdown_grace_s + 5 s, every stream ends with an error event, the run row is clean."""
    raw = fake_models_config({"a": 0.2}, 2, tokens_per_second=20)
    raw["server"] = {"shutdown_grace_s": 2}
    raw["journal"] = {"path": str(tmp_path / "journal.db")}
    with DaemonProcess(write_config(tmp_path / "m.yaml", raw), tmp_path) as d:
        results: list[str] = []
        barrier = threading.Barrier(11)
        threads = [threading.Thread(target=stream_until_end, args=(d.url, "a", results, barrier))
                   for _ in range(10)]
        for t in threads:
            t.start()
        barrier.wait(30)  # all ten are streaming
        t0 = time.monotonic()
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(2 + 5)
        took = time.monotonic() - t0
        for t in threads:
            t.join(10)
    assert code == 0, d.log()
    assert took < 2 + 5
    assert sorted(results) == ["error:shutting_down"] * 10
    con = sqlite3.connect(tmp_path / "journal.db")
    (clean,) = con.execute("SELECT clean_stop FROM runs ORDER BY id DESC LIMIT 1").fetchone()
    outcomes = con.execute("SELECT outcome, count(*) FROM leases GROUP BY outcome").fetchall()
    con.close()
    assert clean == 1
    assert outcomes == [("shutdown", 10)]


def test_second_signal_exits_at_once(tmp_path: Path) -> None:
    """A second SIGTERM during a graceful shutdown ends the process at once; the next start recovers."""
    raw = fake_models_config({"a": 0.2}, 2, tokens_per_second=5)
    raw["server"] = {"shutdown_grace_s": 30}
    raw["journal"] = {"path": str(tmp_path / "journal.db")}
    cfg = write_config(tmp_path / "m.yaml", raw)
    with DaemonProcess(cfg, tmp_path) as d:
        barrier = threading.Barrier(2)
        results: list[str] = []
        t = threading.Thread(target=stream_until_end, args=(d.url, "a", results, barrier))
        t.start()
        barrier.wait(30)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        wait_until_draining(d.url)  # the first signal was handled: a graceful shutdown runs
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(5)
        assert time.monotonic() - t0 < 2
        assert code != 0
        t.join(10)
    with DaemonProcess(cfg, tmp_path) as again:
        status = httpx.get(again.url + "/admin/status").json()
        assert status["journal"]["healthy"] is True
    con = sqlite3.connect(tmp_path / "journal.db")
    assert con.execute("SELECT count(*) FROM leases WHERE outcome = 'interrupted'").fetchone() == (1,)
    con.close()


def test_demo_config_serves_a_chat_request(tmp_path: Path) -> None:
    """`mlxd serve` with no --config runs the offline demo: a chat request to `demo` returns text."""
    ready = tmp_path / "ready"
    env = {**os.environ, "MLXD_STATE_DIR": str(tmp_path / "state")}
    log = open(tmp_path / "log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([*MLXD, "serve", "--port", "0", "--ready-file", str(ready)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not (ready.exists() and ready.read_text().strip()):
            assert proc.poll() is None, (tmp_path / "log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        url = ready.read_text().strip()
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "demo", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].strip()
        assert (tmp_path / "state" / "demo-models" / "tiny" / "config.json").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "log").read_text()
        log.close()


def test_refuses_non_loopback_without_key(tmp_path: Path) -> None:
    """Binding a non-loopback address without an API key is refused with exit 2 unless --insecure."""
    cfg = write_config(tmp_path / "m.yaml", {**fake_models_config({"a": 0.2}, 2),
                                             "journal": {"path": str(tmp_path / "j.db")}})
    env = {k: v for k, v in os.environ.items() if k != "MLXD_API_KEY"}
    r = subprocess.run([*MLXD, "serve", "--config", str(cfg), "--host", "0.0.0.0", "--port", "0"],
                       capture_output=True, text=True, env=env, timeout=60, cwd=REPO)
    assert r.returncode == 2
    assert "--insecure" in r.stderr and "Traceback" not in r.stderr


def test_port_in_use_is_a_one_line_error(tmp_path: Path) -> None:
    """A port that is already taken ends `mlxd serve` with exit 1 and a one-line reason,
    before the journal is touched."""
    cfg = write_config(tmp_path / "m.yaml", {**fake_models_config({"a": 0.2}, 2),
                                             "journal": {"path": str(tmp_path / "j.db")}})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([*MLXD, "serve", "--config", str(cfg), "--port", str(port)],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("mlxd: ") and "Traceback" not in r.stderr
    assert not (tmp_path / "j.db").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="uses /proc")
def test_help_on_every_command() -> None:
    """Every subcommand answers --help with exit 0."""
    for cmd in ("serve", "check-config", "status", "load", "unload", "events", "history",
                "demo-model", "migrate", "launchd-plist"):
        r = subprocess.run([*MLXD, cmd, "--help"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "usage:" in r.stdout, cmd


def _journal_writer_of(pid: int) -> psutil.Process:
    writers = [
        p for p in psutil.Process(pid).children() if "mlxd.journal.writer" in " ".join(p.cmdline())
    ]
    assert len(writers) == 1, writers
    return writers[0]


def _gone(proc: psutil.Process, timeout: float) -> bool:
    """True once ``proc`` has exited (a zombie waiting for its new parent to reap it counts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_the_journal_writer_process_ends_with_the_daemon(tmp_path: Path) -> None:
    """The journal's writer process exits with a graceful stop, and by itself when the daemon is killed."""
    raw = fake_models_config({"a": 0.2}, 2)
    raw["journal"] = {"path": str(tmp_path / "journal.db")}
    cfg = write_config(tmp_path / "m.yaml", raw)
    with DaemonProcess(cfg, tmp_path) as d:
        assert d.proc is not None
        writer = _journal_writer_of(d.proc.pid)
        assert d.terminate() == 0
        assert _gone(writer, 10)
    with DaemonProcess(cfg, tmp_path) as d:
        assert d.proc is not None
        writer = _journal_writer_of(d.proc.pid)
        httpx.post(d.url + "/admin/models/a/load", timeout=30).raise_for_status()
        d.kill()
        assert _gone(writer, 10)  # its pipe from the daemon closed: it writes what came and exits
    with DaemonProcess(cfg, tmp_path) as again:
        status = httpx.get(again.url + "/admin/status").json()
        assert status["journal"]["healthy"] is True
    con = sqlite3.connect(tmp_path / "journal.db")
    runs = con.execute("SELECT clean_stop FROM runs ORDER BY id").fetchall()
    con.close()
    assert runs == [(1,), (0,), (1,)]
