"""Client faults over real HTTP against a `mlxd serve` process (fake engines).

Clients that leave at every moment of a request (waiting for room, while the
model loads, before the first token, mid-stream), then, all at once, clients
that send their headers or body byte by byte, one that stops reading, and a
thousand idle keep-alive connections, while the daemon is told to stop. Each
is checked against the lease outcomes in the journal and the shutdown limit.
"""

from __future__ import annotations

import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.support.clients import StalledReader, chat_body, http_request
from tests.support.daemon import DaemonProcess, write_config

GRACE_S = 2


def daemon_config(tmp: Path) -> Path:
    def fake(name: str, gb: float, **kw: Any) -> dict[str, Any]:
        settings = {"load_seconds": 0.2, "tokens_per_second": 40} | kw
        return {"name": name, "engine": "fake", "estimated_memory_gb": gb, "fake": settings}

    raw = {
        "server": {"shutdown_grace_s": GRACE_S},
        "journal": {"path": str(tmp / "journal.db")},
        "manager": {"memory_budget_gb": 1.0,
                    "contention_policy": {"strategy": "wait_then_fail", "wait_timeout_s": 10}},
        "models": [fake("a", 0.6, reply="x" * 2048 + " "), fake("b", 0.6),
                   fake("slowload", 0.3, load_seconds=2.0),
                   fake("slowtoken", 0.3, tokens_per_second=1)],
    }
    return write_config(tmp / "m.yaml", raw)


def rows(journal: Path, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"file:{journal}?mode=ro", uri=True) as conn:
        return conn.execute(sql).fetchall()


def leave_after(url: str, model: str, seconds: float, *, stream: bool = True) -> None:
    """Send a request, then close the connection ``seconds`` later, whatever came back."""
    with socket.create_connection((urlsplit(url).hostname, urlsplit(url).port)) as sock:
        sock.sendall(http_request(url, "/v1/chat/completions",
                                  chat_body(model, stream=stream, max_tokens=200)))
        time.sleep(seconds)


def trickle(url: str, data: bytes, stop: threading.Event, every: float = 0.2) -> None:
    """Send ``data`` one byte at a time (a slow-loris client) until done or told to stop."""
    try:
        with socket.create_connection((urlsplit(url).hostname, urlsplit(url).port)) as sock:
            for i in range(len(data)):
                if stop.wait(every):
                    return
                sock.send(data[i : i + 1])
            stop.wait(60)
    except OSError:
        return  # the daemon closed it


def eventually(ok: Any, timeout: float = 10.0) -> None:
    """Wait (polling, bounded) for what another process does in its own time."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.05)


def outcome_of(journal: Path, model: str) -> list[str]:
    return [o for (o,) in rows(journal, f"SELECT outcome FROM leases WHERE model = '{model}'"
                                        " ORDER BY acquired_at")]


def test_clients_that_leave_misbehave_or_idle_keep_every_promise(tmp_path: Path) -> None:
    """Clients leaving while waiting, loading, before the first token and mid-stream get the right journal rows; slow-loris clients, a stalled reader and 1,000 idle keep-alive connections neither stall /health nor hold a SIGTERM past shutdown_grace_s + 5 s, and the run is recorded clean."""
    journal = tmp_path / "journal.db"
    d = DaemonProcess(daemon_config(tmp_path), tmp_path)
    d.start()
    stop = threading.Event()
    idle: list[socket.socket] = []
    try:
        with httpx.Client(base_url=d.url, timeout=30) as c:
            # 1. leaves while waiting for room: b needs a's room, a is streaming
            with c.stream("POST", "/v1/chat/completions",
                          json=chat_body("a", stream=True, max_tokens=60)) as held:
                lines = held.iter_lines()
                next(lines)
                leave_after(d.url, "b", 0.5)
                rest = list(lines)
            assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
            assert outcome_of(journal, "b") == []  # it never got a lease
            assert ("a", "draining", "loaded", "abandoned") in rows(
                journal, "SELECT model, from_state, to_state, reason FROM transitions")
            # 2. leaves while its model loads: the load is abandoned
            leave_after(d.url, "slowload", 0.5)
            eventually(lambda: c.get("/v1/models/slowload").json()["status"] == "unloaded")
            # the journal writer commits in its own time: wait for the row, do not race it
            eventually(lambda: rows(journal, "SELECT from_state, to_state, reason FROM transitions"
                                             " WHERE model = 'slowload'")[-1:]
                       == [("loading", "unloaded", "abandoned")])
            # 3. leaves before the first token (one token a second), 4. leaves mid-stream
            assert c.post("/admin/models/slowtoken/load").status_code == 200
            leave_after(d.url, "slowtoken", 0.3)
            leave_after(d.url, "b", 0.6)
            eventually(lambda: None not in outcome_of(journal, "slowtoken") + outcome_of(journal, "b"))
            assert outcome_of(journal, "slowtoken") == ["disconnected"]
            assert outcome_of(journal, "b") == ["disconnected"]
            # 5. misbehaving and idle clients, all at once, then SIGTERM
            headers = http_request(d.url, "/v1/chat/completions", chat_body("b", stream=False))
            head, _, body = headers.partition(b"\r\n\r\n")
            threading.Thread(target=trickle, args=(d.url, headers, stop), daemon=True).start()
            threading.Thread(target=trickle, args=(d.url, head + b"\r\n\r\n" + body, stop),
                             daemon=True).start()
            stalled = StalledReader(d.url, "a")
            stalled.wait_stalled()
            for _ in range(1000):
                s = socket.create_connection((urlsplit(d.url).hostname, urlsplit(d.url).port))
                s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
                idle.append(s)
            for s in idle:
                assert s.recv(4096).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert c.get("/health", timeout=5).status_code == 200
            assert time.monotonic() - t0 < 1.0
        assert d.proc is not None
        t0 = time.monotonic()
        d.proc.terminate()
        rc = d.proc.wait(GRACE_S + 5 + 2)
        took = time.monotonic() - t0
    finally:
        stop.set()
        for s in idle:
            s.close()
        d.kill()
    assert rc == 0, d.log()[-2000:]
    assert took <= GRACE_S + 5, f"exit took {took:.1f} s"
    assert rows(journal, "SELECT clean_stop FROM runs") == [(1,)], d.log()[-2000:]
    assert rows(journal, "SELECT count(*) FROM leases WHERE released_at IS NULL") == [(0,)]
    assert outcome_of(journal, "a")[-1] == "shutdown"  # the stalled reader's lease
