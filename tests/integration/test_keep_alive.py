"""Idle keep-alive connections are closed by the real `mlxd serve` process, served or not."""

from __future__ import annotations

import selectors
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from tests.integration.conftest import fake
from tests.support.daemon import DaemonProcess, write_config

#: hypercorn's keep_alive_timeout as the daemon sets it
KEEP_ALIVE_S = 5.0
REQUEST = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"


def test_idle_connections_that_served_requests_are_closed(tmp_path: Path) -> None:
    """50 connections that each served one request (25 of them pipelined two) are closed by the server within the keep-alive timeout + 1 s, and the daemon's fds return to their baseline."""
    cfg = write_config(tmp_path / "models.yaml", {
        "manager": {"memory_budget_gb": 1}, "models": [fake("a", 0.1)]})
    with DaemonProcess(cfg, tmp_path) as d:
        assert d.proc is not None
        daemon = psutil.Process(d.proc.pid)
        url = urlsplit(d.url)
        baseline = daemon.num_fds()
        sel = selectors.DefaultSelector()
        want: dict[socket.socket, int] = {}
        for i in range(50):
            s = socket.create_connection((url.hostname, url.port))
            s.setblocking(False)
            n = 2 if i % 2 else 1
            s.sendall(REQUEST * n)
            want[s] = n
            sel.register(s, selectors.EVENT_READ, {"got": b"", "answered_at": None})
        closed_after: list[float] = []
        deadline = time.monotonic() + KEEP_ALIVE_S + 15
        while sel.get_map() and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.2):
                s, state = key.fileobj, key.data
                assert isinstance(s, socket.socket)
                data = s.recv(65536)
                now = time.monotonic()
                if data:
                    state["got"] += data
                    if state["got"].count(b"HTTP/1.1 200") == want[s]:
                        state["answered_at"] = now
                    continue
                assert state["answered_at"] is not None, state["got"][:200]
                closed_after.append(now - state["answered_at"])
                sel.unregister(s)
                s.close()
        left = len(sel.get_map())
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        assert left == 0, f"{left} of 50 served connections still open after {KEEP_ALIVE_S + 15:g} s"
        assert max(closed_after) <= KEEP_ALIVE_S + 1.0, sorted(closed_after)[-5:]
        fds_deadline = time.monotonic() + 5
        while daemon.num_fds() > baseline and time.monotonic() < fds_deadline:
            time.sleep(0.05)
        print(f"closed {min(closed_after):.2f}-{max(closed_after):.2f} s after their last answer; "
              f"fds {daemon.num_fds()} (baseline {baseline})")
        assert daemon.num_fds() <= baseline, (daemon.num_fds(), baseline)
