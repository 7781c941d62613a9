"""SIGHUP and `/admin/reload` on a real `mlxd serve` process (issue 32, findings 5 and 6)."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.integration.test_daemon_process import stream_until_end
from tests.support.daemon import DaemonProcess, fake_models_config, write_config


def _config(tmp: Path, sizes: dict[str, float], **server: Any) -> dict[str, Any]:
    raw = fake_models_config(sizes, 2, tokens_per_second=20)
    raw["server"] = {"shutdown_grace_s": 2, **server}  # no port: the command line's --port 0 rules
    raw["journal"] = {"path": str(tmp / "journal.db")}
    return raw


def _models(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]


def _wait_for(check: Any, what: str, timeout: float = 20.0) -> None:
    """Poll the daemon (no event crosses processes) until ``check()`` holds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def test_sighup_reloads_the_config_and_a_running_stream_goes_on(tmp_path: Path) -> None:
    """SIGHUP while a stream runs: the new model of the file appears, the stream ends with [DONE], a bad file is refused with a log line and the daemon keeps serving, and SIGTERM then stops cleanly with every lease completed."""
    path = write_config(tmp_path / "m.yaml", _config(tmp_path, {"a": 0.2}))
    with DaemonProcess(path, tmp_path) as d:
        assert d.proc is not None
        results: list[str] = []
        started = threading.Barrier(2)
        payload_thread = threading.Thread(target=stream_until_end,  # 60 tokens: 3 s at 20/s
                                          args=(d.url, "a", results, started, 60))
        payload_thread.start()
        started.wait(30)  # the stream has sent its first chunk
        write_config(path, _config(tmp_path, {"a": 0.2, "b": 0.2}))
        d.proc.send_signal(signal.SIGHUP)
        _wait_for(lambda: "b" in _models(d.url), "model b added by SIGHUP")
        payload_thread.join(30)
        assert results == ["done"], d.log()
        assert d.proc.poll() is None

        path.write_text("models: [{name: c, engine: fake}]\nbogus_key: 1\n")
        d.proc.send_signal(signal.SIGHUP)
        _wait_for(lambda: "SIGHUP: the config was not reloaded" in d.log(), "the refusal logged")
        assert "bogus_key" in d.log()
        assert _models(d.url) == ["a", "b"]
        r = httpx.post(d.url + "/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text
        assert d.terminate(2 + 5 + 2) == 0, d.log()
    con = sqlite3.connect(tmp_path / "journal.db")
    (clean,) = con.execute("SELECT clean_stop FROM runs ORDER BY id DESC LIMIT 1").fetchone()
    outcomes = con.execute("SELECT DISTINCT outcome FROM leases").fetchall()
    reasons = con.execute("SELECT DISTINCT reason FROM transitions").fetchall()
    con.close()
    assert clean == 1
    assert outcomes == [("completed",)]
    assert ("crash_recovery",) not in reasons


def test_reload_of_a_port_0_daemon_reports_no_restart_for_an_unchanged_file(tmp_path: Path) -> None:
    """A daemon started with --port 0 and no port in its file reloads the unchanged file with restart_needed empty, and still reports a real server change, running value first."""
    path = write_config(tmp_path / "m.yaml", _config(tmp_path, {"a": 0.2}))
    with DaemonProcess(path, tmp_path) as d:
        r = httpx.post(d.url + "/admin/reload", timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["restart_needed"] == []
        write_config(path, _config(tmp_path, {"a": 0.2}, max_body_mb=8))
        r = httpx.post(d.url + "/admin/reload", timeout=30)
        assert r.json()["restart_needed"] == ["server.max_body_mb: 32.0 -> 8.0"]


def test_plan_with_a_bad_contention_names_the_query_parameter(tmp_path: Path) -> None:
    """`/admin/plan?contention=bogus` is a 400 whose param and message name `contention`, the parameter it was given."""
    path = write_config(tmp_path / "m.yaml", _config(tmp_path, {"a": 0.2}))
    with DaemonProcess(path, tmp_path) as d:
        r = httpx.get(d.url + "/admin/plan", params={"model": "a", "contention": "bogus"}, timeout=10)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "contention", r.text
        assert err["message"].startswith("contention: must be one of fail, wait"), err
        assert "X-Mlxd-Contention" not in err["message"]
