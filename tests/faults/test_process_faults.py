"""Process faults against a `mlxd serve` process: the journal writer stopped, its disk full, its directory read-only.

Each time the promise is the same: while the journal cannot write, the daemon
serves what is resident, refuses loads with 503 ``journal_unavailable`` and
reports ``degraded`` on ``/health``; when it can write again it recovers by
itself, and no row is lost or reordered. (SIGKILL of the writer is in
``tests/integration/test_hostile.py``.)
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from mlxd.journal.replay import check_journal
from tests.support.clients import chat_body
from tests.support.daemon import DaemonProcess, write_config


def config(tmp: Path, journal: Path) -> Path:
    def fake(name: str) -> dict[str, Any]:
        return {"name": name, "engine": "fake", "estimated_memory_gb": 0.4,
                "fake": {"load_seconds": 0.1, "tokens_per_second": 200}}

    raw = {"journal": {"path": str(journal)}, "manager": {"memory_budget_gb": 1.0},
           "models": [fake("a"), fake("b")]}
    return write_config(tmp / "m.yaml", raw)


def eventually(ok: Callable[[], bool], timeout: float = 20.0) -> None:
    """Wait (polling, bounded) for what another process does in its own time."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.1)


def writer_of(d: DaemonProcess) -> int:
    assert d.proc is not None
    (pid,) = [p.pid for p in psutil.Process(d.proc.pid).children()]
    return pid


class Served:
    """Requests made while the journal is down, and the promises checked meanwhile."""

    def __init__(self, c: httpx.Client) -> None:
        self.c = c
        self.leases = 0

    def resident_model_is_served(self) -> None:
        r = self.c.post("/v1/chat/completions", json=chat_body("a", stream=False, max_tokens=2))
        assert r.status_code == 200, r.text
        self.leases += 1

    def degraded(self) -> bool:
        return self.c.get("/health").json()["status"] == "degraded"

    def loads_are_refused(self) -> None:
        r = self.c.post("/v1/chat/completions", json=chat_body("b", stream=False, max_tokens=2))
        assert r.status_code == 503 and r.json()["error"]["code"] == "journal_unavailable", r.text
        assert self.c.get("/v1/models/b").json()["status"] == "unloaded"

    def recovered(self) -> bool:
        j = self.c.get("/admin/status").json()["journal"]
        return bool(j["healthy"]) and j["committed_seq"] == j["last_seq"]


def journal_is_whole(journal: Path, leases: int) -> None:
    with sqlite3.connect(f"file:{journal}?mode=ro", uri=True) as conn:
        assert check_journal(conn) == []
        outcomes = [o for (o,) in conn.execute("SELECT outcome FROM leases ORDER BY acquired_at")]
        assert outcomes == ["completed"] * leases
        assert conn.execute("SELECT clean_stop FROM runs").fetchall()[-1] == (1,)


def journal_down_and_back(
    tmp: Path,
    journal: Path,
    break_it: Callable[[DaemonProcess], Callable[[], None]],
    wrapper: tuple[str, ...] = (),
) -> None:
    """Serve, break the journal, check the promises while it is down, mend it, check nothing was lost."""
    daemon = DaemonProcess(config(tmp, journal), tmp, wrapper=wrapper)
    with daemon as d, httpx.Client(base_url=d.url, timeout=30) as c:
        s = Served(c)
        assert c.post("/admin/models/a/load").status_code == 200
        s.resident_model_is_served()
        mend = break_it(d)
        s.resident_model_is_served()  # records queue meanwhile
        eventually(lambda: (s.resident_model_is_served(), s.degraded())[1])
        s.loads_are_refused()
        for _ in range(3):
            s.resident_model_is_served()
        mend()
        eventually(s.recovered)
        eventually(lambda: c.get("/health").json()["status"] == "ok")  # the load gate reopens
        assert c.post("/v1/chat/completions",
                      json=chat_body("b", stream=False, max_tokens=2)).status_code == 200
        s.leases += 1
    journal_is_whole(journal, s.leases)


def test_a_stopped_writer_degrades_and_recovers(tmp_path: Path) -> None:
    """SIGSTOP of the journal writer: /health degraded within a few seconds, loads refused, resident models served; SIGCONT: it catches up, nothing lost."""
    def stop(d: DaemonProcess) -> Callable[[], None]:
        pid = writer_of(d)
        os.kill(pid, signal.SIGSTOP)
        return lambda: os.kill(pid, signal.SIGCONT)

    journal_down_and_back(tmp_path, tmp_path / "journal.db", stop)


@pytest.mark.stress
def test_a_writer_stopped_for_good_is_replaced(tmp_path: Path) -> None:
    """SIGSTOP of the journal writer, never continued: after 10 s it is killed and replaced, and nothing is lost."""
    pids: list[int] = []

    def stop(d: DaemonProcess) -> Callable[[], None]:
        pids.append(writer_of(d))
        os.kill(pids[0], signal.SIGSTOP)
        return lambda: eventually(lambda: writer_of(d) != pids[0], timeout=30)

    journal_down_and_back(tmp_path, tmp_path / "journal.db", stop)


def test_a_full_disk_degrades_and_recovers(tmp_path: Path) -> None:
    """The journal's file cannot grow (its writer's file-size limit, as on a full disk): degraded, loads refused, resident models served; room again: every row written."""
    journal = tmp_path / "journal.db"

    def fill(d: DaemonProcess) -> Callable[[], None]:
        pid = writer_of(d)
        sizes = [p.stat().st_size for p in tmp_path.glob("journal.db*") if p.is_file()]
        soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (max(sizes) + 4096, hard))
        return lambda: resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))

    journal_down_and_back(tmp_path, journal, fill)


def without_root_powers() -> tuple[str, ...]:
    """A command prefix under which root obeys file permissions (none needed for others)."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("as root, a read-only directory needs setpriv to drop CAP_DAC_OVERRIDE")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--")


def test_a_journal_directory_made_read_only_degrades_and_recovers(tmp_path: Path) -> None:
    """The journal's directory and files turn read-only mid-run (and its writer has to reopen them): degraded, loads refused, resident models served; writable again: every row written."""
    journal = tmp_path / "db" / "journal.db"
    journal.parent.mkdir()

    def read_only(d: DaemonProcess) -> Callable[[], None]:
        files = [journal.parent, *journal.parent.iterdir()]
        for p in files:
            p.chmod(0o555 if p.is_dir() else 0o444)
        os.kill(writer_of(d), signal.SIGKILL)  # its open files would stay writable

        def writable() -> None:
            for p in files:
                p.chmod(0o755 if p.is_dir() else 0o644)
        return writable

    journal_down_and_back(tmp_path, journal, read_only, wrapper=without_root_powers())
