"""The journal: rows and sequence numbers, group commit, the watermark, failure and recovery."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from mlxd.config import Measurement
from mlxd.errors import ConfigError, JournalError
from mlxd.journal.journal import Journal
from mlxd.journal.migrate import open_database, open_readonly
from mlxd.journal.replay import check_journal, replay
from mlxd.residency.events import LeaseAcquired, LeaseReleased, MeasurementEvent, TransitionEvent
from mlxd.residency.states import Outcome, Reason, State

REPO = Path(__file__).resolve().parents[2]


class FakeWall:
    """An injected wall clock that only moves when told."""

    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@asynccontextmanager
async def running(path: Path, *, begin: bool = True, **kw: Any) -> AsyncIterator[Journal]:
    """A started journal (with this run begun); cancelled, flushed and joined on exit."""
    j = Journal(path, **kw)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        if begin:
            await j.begin_run(4242, "test", "/etc/mlxd.yaml")
        yield j
        nursery.cancel_scope.cancel()


def tr(
    model: str, a: State, b: State, reason: Reason = Reason.REQUEST, at: float = 1.0, **kw: Any
) -> TransitionEvent:
    return TransitionEvent(model, a, b, reason, at, **kw)


def load_path(model: str, at: float = 1.0) -> list[TransitionEvent]:
    return [
        tr(model, State.UNLOADED, State.LOADING, at=at),
        tr(model, State.LOADING, State.LOADED, at=at, memory_bytes=10),
    ]


def rows(path: Path, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


async def test_each_event_lands_in_its_table_with_one_sequence(tmp_path: Path) -> None:
    """Transitions, leases and measurements land in their tables; a transition's seq is its events seq."""
    path = tmp_path / "j.db"
    async with running(path) as j:
        seqs = [j.record(e) for e in load_path("qwen")]
        seqs.append(j.record(LeaseAcquired("L1", "qwen", "req-1", "/v1/chat/completions", 2.0)))
        seqs.append(j.record(MeasurementEvent("qwen", 2.0, 1234, 0.5)))
        seqs.append(j.record(LeaseReleased("L1", "qwen", Outcome.COMPLETED, 3.0, 7, 11, 1.0)))
        await j.wait_committed()
        assert seqs == [1, 2, 3, 4, 5]
        assert j.committed_seq == 5 and j.run_id == 1
    assert rows(path, "SELECT seq, from_state, to_state, memory_bytes FROM transitions") == [
        (1, "unloaded", "loading", None),
        (2, "loading", "loaded", 10),
    ]
    assert rows(path, "SELECT seq, kind FROM events ORDER BY seq") == [
        (1, "transition"), (2, "transition"), (3, "lease_acquired"), (5, "lease_released"),
    ]  # fmt: skip
    assert rows(path, "SELECT id, run_id, route, acquired_at, released_at, outcome, prompt_tokens,"
                " completion_tokens FROM leases") == [
        ("L1", 1, "/v1/chat/completions", 2.0, 3.0, "completed", 7, 11)
    ]  # fmt: skip
    assert rows(path, "SELECT model, memory_bytes, load_seconds FROM measurements") == [
        ("qwen", 1234, 0.5)
    ]
    assert rows(path, "SELECT pid, version, config_path FROM runs") == [
        (4242, "test", "/etc/mlxd.yaml")
    ]
    assert check_journal(open_readonly(path)) == []


async def test_a_leases_kv_wait_lands_in_its_row_batched_or_not(tmp_path: Path) -> None:
    """``kv_wait_seconds`` reaches ``leases`` whether the release comes in the batch of its acquire
    (one INSERT) or in a later one (an UPDATE); NULL when no reservation waited; the history
    reads it."""
    path = tmp_path / "j.db"
    async with running(path) as j:
        j.record(LeaseAcquired("A", "m", None, "/v1/chat/completions", 1.0))
        j.record(LeaseReleased("A", "m", Outcome.COMPLETED, 2.0, 5, 6, 1.0, 0.75))
        j.record(LeaseAcquired("B", "m", None, "/v1/chat/completions", 3.0))
        await j.wait_committed()
        j.record(LeaseReleased("B", "m", Outcome.COMPLETED, 4.0, 5, 6, 1.0, 1.5))
        j.record(LeaseAcquired("C", "m", None, "/v1/chat/completions", 5.0))
        j.record(LeaseReleased("C", "m", Outcome.COMPLETED, 6.0, 5, 6, 1.0))
        await j.wait_committed()
        assert [(r["id"], r["kv_wait_seconds"]) for r in j.leases()] == [
            ("A", 0.75), ("B", 1.5), ("C", None),
        ]  # fmt: skip
    assert rows(path, "SELECT id, kv_wait_seconds FROM leases ORDER BY id") == [
        ("A", 0.75), ("B", 1.5), ("C", None),
    ]  # fmt: skip


async def test_event_payloads_are_the_events_as_dict(tmp_path: Path) -> None:
    """Each events row's payload is exactly the manager event's as_dict() in JSON."""
    events: list[Any] = [
        tr("m", State.UNLOADED, State.LOADING, Reason.PRELOAD, at=1.5, memory_bytes=7, error="x"),
        LeaseAcquired("L", "m", "rq", "/v1/completions", 2.5),
        LeaseReleased("L", "m", Outcome.PREEMPTED, 3.5, 1, 2, 0.25),
    ]
    async with running(tmp_path / "j.db") as j:
        for e in events:
            j.record(e)
        await j.wait_committed()
        stored = [row["payload"] for row in j.events_after(0)]
    assert stored == [json.loads(json.dumps(e.as_dict())) for e in events]


async def test_a_burst_costs_far_fewer_commits_than_rows(tmp_path: Path) -> None:
    """500 records queued in one burst are written in a handful of transactions (group commit)."""
    async with running(tmp_path / "j.db") as j:
        before = j.commit_count
        for i in range(250):
            j.record(LeaseAcquired(f"L{i}", "m", None, None, float(i)))
            j.record(LeaseReleased(f"L{i}", "m", Outcome.COMPLETED, float(i)))
        await j.wait_committed()
        commits = j.commit_count - before
        assert 1 <= commits <= 25, commits
        assert len(j.leases(limit=None)) == 250


async def test_watermark_covers_every_earlier_seq(tmp_path: Path) -> None:
    """When wait_committed(seq) returns, that row and every row before it are readable on disk."""
    path = tmp_path / "j.db"
    seen: list[tuple[int, int]] = []
    async with running(path) as j:

        async def worker(w: int) -> None:
            for i in range(20):
                seq = j.record(LeaseAcquired(f"w{w}-{i}", f"m{w}", None, None, float(i)))
                await j.wait_committed(seq)
                on_disk = rows(path, "SELECT max(seq), count(*) FROM events WHERE seq <= ?", seq)[0]
                seen.append((seq, on_disk[1]))
                assert on_disk[0] == seq

        async with trio.open_nursery() as n:
            for w in range(10):
                n.start_soon(worker, w)
        assert j.committed_seq == j.last_seq == 200
    # dense sequence here (no measurements): every seq up to the watermark is present
    assert all(count == seq for seq, count in seen)


async def test_wait_for_a_future_seq_is_a_programming_error(tmp_path: Path) -> None:
    """Waiting for a seq that was never handed out raises ValueError instead of hanging."""
    async with running(tmp_path / "j.db") as j:
        seq = j.record(MeasurementEvent("m", 1.0, 1, 1.0))
        with pytest.raises(ValueError, match="has not been recorded"):
            await j.wait_committed(seq + 1)


async def test_record_needs_a_begun_run(tmp_path: Path) -> None:
    """record() before begin_run() is refused, and begin_run() only once."""
    async with running(tmp_path / "j.db", begin=False) as j:
        with pytest.raises(RuntimeError, match="begin_run"):
            j.record(MeasurementEvent("m", 1.0, 1, 1.0))
        await j.begin_run(1, "v", None)
        with pytest.raises(RuntimeError, match="only once"):
            await j.begin_run(1, "v", None)


async def test_a_rejected_row_fails_alone(tmp_path: Path) -> None:
    """A row the schema refuses raises on its own seq while the rest of its batch commits."""
    async with running(tmp_path / "j.db") as j:
        ok1 = j.record(LeaseAcquired("A", "m", None, None, 1.0))
        bad = j.record(LeaseReleased("nope", "m", Outcome.COMPLETED, 2.0))
        dup = j.record(LeaseAcquired("A", "m", None, None, 3.0))
        ok2 = j.record(LeaseReleased("A", "m", Outcome.CANCELLED, 4.0))
        await j.wait_committed(ok2)
        await j.wait_committed(ok1)
        with pytest.raises(JournalError, match=f"seq {bad} was not written.*no open row"):
            await j.wait_committed(bad)
        with pytest.raises(JournalError, match="IntegrityError"):
            await j.wait_committed(dup)
        assert j.healthy
        assert [e["seq"] for e in j.events_after(0)] == [ok1, ok2]
        assert [(r["id"], r["outcome"]) for r in j.leases()] == [("A", "cancelled")]


async def test_locked_file_degrades_then_recovers_without_loss(tmp_path: Path) -> None:
    """While another connection holds the write lock the journal is unhealthy; afterwards no row is lost."""
    path = tmp_path / "j.db"
    async with running(path, busy_timeout_ms=30, retry_initial=0.01, retry_max=0.05) as j:
        first = j.record(LeaseAcquired("L0", "m", None, None, 0.0))
        await j.wait_committed(first)
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        seqs = [j.record(LeaseAcquired(f"L{i}", "m", None, None, float(i))) for i in range(1, 6)]
        with pytest.raises(JournalError, match="locked"):
            await j.wait_committed(seqs[0])
        assert not j.healthy
        assert j.last_error is not None and "locked" in j.last_error
        seqs += [j.record(LeaseAcquired(f"L{i}", "m", None, None, float(i))) for i in range(6, 9)]
        assert j.committed_seq == first  # nothing written while locked
        blocker.execute("ROLLBACK")
        blocker.close()
        await j.wait_committed()
        assert j.healthy
        assert [e["seq"] for e in j.events_after(0)] == [first, *seqs]
        assert [r["id"] for r in j.leases(limit=None)] == [f"L{i}" for i in range(9)]


async def test_subscribers_hear_only_committed_events(tmp_path: Path) -> None:
    """A subscriber receives an event only after its commit, with the same payload as events_after."""
    path = tmp_path / "j.db"
    async with running(path, busy_timeout_ms=30, retry_initial=0.01, retry_max=0.05) as j:
        with j.subscribe() as sub:
            blocker = sqlite3.connect(path, isolation_level=None)
            blocker.execute("BEGIN EXCLUSIVE")
            seq = j.record(tr("m", State.UNLOADED, State.LOADING))
            with pytest.raises(JournalError):
                await j.wait_committed(seq)
            with pytest.raises(trio.WouldBlock):
                sub._receive.receive_nowait()
            blocker.execute("ROLLBACK")
            blocker.close()
            await j.wait_committed(seq)
            got = await sub.__anext__()
            assert got == (seq, j.events_after(seq - 1)[0]["payload"])
            assert got[1] == {
                "kind": "transition", "model": "m", "from_state": "unloaded", "to_state": "loading",
                "reason": "request", "at": 1.0, "memory_bytes": None, "error": None, "cause": None,
            }  # fmt: skip
            assert sub.last_seq == seq


async def test_a_slow_subscriber_is_dropped_and_resumes_from_the_file(tmp_path: Path) -> None:
    """A subscriber whose buffer fills is dropped with a flag, and events_after fills the gap."""
    async with running(tmp_path / "j.db") as j:
        fast = j.subscribe()
        slow = j.subscribe(buffer=2)
        seqs = [j.record(LeaseAcquired(f"L{i}", "m", None, None, float(i))) for i in range(5)]
        await j.wait_committed()
        got = [seq async for seq, _ in slow]
        assert slow.dropped and got == seqs[:2]
        resumed = [e["seq"] for e in j.events_after(slow.last_seq or 0)]
        assert got + resumed == seqs
        assert not fast.dropped
        assert [(await fast.__anext__())[0] for _ in seqs] == seqs


async def test_events_after_resumes_in_order_with_limit(tmp_path: Path) -> None:
    """events_after(seq, limit) returns the next events above seq, in order, payloads decoded."""
    async with running(tmp_path / "j.db") as j:
        for e in load_path("a") + load_path("b"):
            j.record(e)
        j.record(MeasurementEvent("a", 1.0, 5, 1.0))  # takes seq 5, no events row
        j.record(tr("a", State.LOADED, State.UNLOADING, Reason.IDLE_TIMEOUT))
        await j.wait_committed()
        assert [e["seq"] for e in j.events_after(0)] == [1, 2, 3, 4, 6]
        page = j.events_after(2, limit=2)
        assert [(e["seq"], e["model"], e["payload"]["to_state"]) for e in page] == [
            (3, "b", "loading"), (4, "b", "loaded"),
        ]  # fmt: skip
        assert j.events_after(6) == []


async def test_recovery_after_a_run_that_died(tmp_path: Path) -> None:
    """After a run without a clean stop: leases closed as interrupted, crash_recovery rows, residents reported."""
    path = tmp_path / "j.db"
    async with running(path) as j:
        for e in [
            *load_path("loaded"),
            *load_path("draining"), tr("draining", State.LOADED, State.DRAINING, Reason.EVICTED),
            *load_path("unloading"), tr("unloading", State.LOADED, State.UNLOADING, Reason.IDLE_TIMEOUT),
            tr("loading", State.UNLOADED, State.LOADING),
            tr("failed", State.UNLOADED, State.LOADING), tr("failed", State.LOADING, State.FAILED, Reason.LOAD_FAILED),
            *load_path("gone"), tr("gone", State.LOADED, State.UNLOADING, Reason.ADMIN),
            tr("gone", State.UNLOADING, State.UNLOADED, Reason.ADMIN),
            LeaseAcquired("open-1", "loaded", "r1", "/v1/completions", 5.0),
            LeaseAcquired("done", "loaded", "r2", "/v1/completions", 5.0),
            LeaseReleased("done", "loaded", Outcome.COMPLETED, 6.0),
            LeaseAcquired("open-2", "draining", "r3", "/v1/chat/completions", 7.0),
        ]:  # fmt: skip
            j.record(e)
        await j.wait_committed()
        # no end_run: the run stops without a clean stop, as after kill -9
    wall = FakeWall()
    async with running(path, begin=False, wall_clock=wall) as j:
        sub = j.subscribe()
        report = await j.begin_run(99, "test", None)
        assert report.run_id == 2 and report.previous_run_id == 1 and report.crashed
        assert report.resident == ("loaded", "draining")
        assert dict(report.recovered) == {
            "loaded": State.LOADED, "draining": State.DRAINING, "unloading": State.UNLOADING, "loading": State.LOADING,
        }  # fmt: skip
        assert report.interrupted_leases == ("open-1", "open-2")
        recovery = j.history(since=wall.t)
        assert {(r["model"], r["from_state"], r["to_state"], r["reason"], r["run_id"]) for r in recovery} == {
            (m, str(s), "unloaded", "crash_recovery", 2) for m, s in report.recovered
        }  # fmt: skip
        leases = {r["id"]: r for r in j.leases()}
        assert leases["open-1"]["outcome"] == leases["open-2"]["outcome"] == "interrupted"
        assert leases["open-1"]["released_at"] == wall.t
        assert leases["done"]["outcome"] == "completed"
        # the repairs are events too, published and resumable
        assert [s for s, _ in [await sub.__anext__() for _ in range(6)]] == list(
            range(j.last_seq - 5, j.last_seq + 1)
        )
        seq = j.record(tr("loaded", State.UNLOADED, State.LOADING, Reason.RESTORE))
        await j.wait_committed(seq)
        assert seq == j.last_seq
    conn = open_readonly(path)
    assert check_journal(conn) == []
    everything = conn.execute("SELECT * FROM transitions ORDER BY seq").fetchall()
    assert replay(everything) == {
        "loaded": State.LOADING, "draining": State.UNLOADED, "unloading": State.UNLOADED,
        "loading": State.UNLOADED, "failed": State.FAILED, "gone": State.UNLOADED,
    }  # fmt: skip


async def test_clean_stop_reports_what_was_resident_before_shutdown(tmp_path: Path) -> None:
    """After a clean stop nothing is repaired and the residents are the models loaded before shutdown."""
    path = tmp_path / "j.db"
    wall = FakeWall()
    async with running(path, wall_clock=wall) as j:
        for e in [
            *load_path("a"), *load_path("b"), *load_path("c"), tr("c", State.LOADED, State.UNLOADING, Reason.ADMIN),
            tr("c", State.UNLOADING, State.UNLOADED, Reason.ADMIN), tr("d", State.UNLOADED, State.LOADING),
            # shutdown: a busy model drains, an idle one unloads, a load in flight is abandoned
            tr("a", State.LOADED, State.DRAINING, Reason.SHUTDOWN), tr("a", State.DRAINING, State.UNLOADING, Reason.SHUTDOWN),
            tr("a", State.UNLOADING, State.UNLOADED, Reason.SHUTDOWN), tr("b", State.LOADED, State.UNLOADING, Reason.SHUTDOWN),
            tr("b", State.UNLOADING, State.UNLOADED, Reason.SHUTDOWN), tr("d", State.LOADING, State.UNLOADED, Reason.SHUTDOWN),
        ]:  # fmt: skip
            j.record(e)
        wall.t += 60
        end = j.end_run(clean=True)
        await j.wait_committed(end)
        with pytest.raises(JournalError, match="run has ended"):
            j.record(MeasurementEvent("a", 1.0, 1, 1.0))
    assert rows(path, "SELECT stopped_at, clean_stop FROM runs") == [(wall.t, 1)]
    async with running(path, begin=False) as j:
        report = await j.begin_run(1, "test", None)
        assert not report.crashed
        assert report.resident == ("a", "b")
        assert report.recovered == () and report.interrupted_leases == ()


async def test_end_run_unclean_is_recovered_like_a_crash(tmp_path: Path) -> None:
    """end_run(clean=False) stamps the stop time but the next start still treats the run as crashed."""
    path = tmp_path / "j.db"
    async with running(path, wall_clock=FakeWall(5.0)) as j:
        j.end_run(clean=False)
    assert rows(path, "SELECT stopped_at, clean_stop FROM runs") == [(5.0, 0)]
    async with running(path, begin=False) as j:
        assert (await j.begin_run(1, "test", None)).crashed


async def test_cancelling_run_flushes_everything_queued(tmp_path: Path) -> None:
    """Cancelling run() writes every row already recorded before the writer process exits."""
    path = tmp_path / "j.db"
    async with running(path) as j:
        for i in range(300):
            j.record(LeaseAcquired(f"L{i}", "m", None, None, float(i)))
        j.end_run(clean=True)
    assert rows(path, "SELECT count(*) FROM leases") == [(300,)]
    assert rows(path, "SELECT clean_stop FROM runs") == [(1,)]
    with pytest.raises(JournalError, match="closed"):
        j.record(MeasurementEvent("m", 1.0, 1, 1.0))


async def test_shutdown_gives_up_after_flush_timeout(tmp_path: Path) -> None:
    """If the file stays locked, cancelling run() returns after flush_timeout and waiters get an error."""
    path = tmp_path / "j.db"
    blocker = sqlite3.connect(path, isolation_level=None)
    async with running(path, busy_timeout_ms=20, retry_initial=0.01, flush_timeout=0.3) as j:
        blocker.execute("BEGIN EXCLUSIVE")
        seq = j.record(MeasurementEvent("m", 1.0, 1, 1.0))
        t0 = trio.current_time()
    assert 0.3 <= trio.current_time() - t0 < 5
    blocker.execute("ROLLBACK")
    with pytest.raises(JournalError, match=f"closed before seq {seq}"):
        await j.wait_committed(seq)
    assert rows(path, "SELECT count(*) FROM measurements") == [(0,)]


async def test_second_daemon_on_the_same_file_is_refused(tmp_path: Path) -> None:
    """A second journal on a file another one is writing fails to start with a clear error."""
    path = tmp_path / "j.db"
    async with running(path):
        other = Journal(path)
        async with trio.open_nursery() as n:
            with pytest.raises(
                JournalError, match=rf"in use by another mlxd \(pid {os.getpid()}\)"
            ):
                await n.start(other.run)


async def test_a_newer_schema_refuses_to_start(tmp_path: Path) -> None:
    """A journal file from a newer mlxd makes run() fail before it reports started."""
    path = tmp_path / "j.db"
    conn = open_database(path)
    conn.execute("PRAGMA user_version = 42")
    conn.close()
    async with trio.open_nursery() as n:
        with pytest.raises(ConfigError, match="v42 is newer"):
            await n.start(Journal(path).run)


async def test_readers_latest_measurements_and_filters(tmp_path: Path) -> None:
    """latest_measurements keeps each model's newest size and weights; history/leases filter by model, since and limit."""
    async with running(tmp_path / "j.db") as j:
        j.record(MeasurementEvent("a", 1.0, 100, 1.0, "w1"))
        j.record(MeasurementEvent("a", 3.0, 300, 1.0, "w3"))
        j.record(MeasurementEvent("b", 2.0, 200, 1.0))
        for e in [*load_path("a", at=10.0), *load_path("b", at=20.0)]:
            j.record(e)
        j.record(LeaseAcquired("x", "a", None, None, 30.0))
        await j.wait_committed()
        assert j.latest_measurements() == {"a": Measurement(300, "w3"), "b": Measurement(200)}
        assert [r["model"] for r in j.history(model="b")] == ["b", "b"]
        assert [r["at"] for r in j.history(since=15.0)] == [20.0, 20.0]
        assert [r["to_state"] for r in j.history(limit=1)] == ["loaded"]
        assert [r["id"] for r in j.leases(open_only=True)] == ["x"]
        assert j.leases(model="b") == []


_WRITER = """
import os, sys, trio
from mlxd.journal.journal import Journal
from mlxd.residency.events import TransitionEvent, LeaseAcquired, LeaseReleased
from mlxd.residency.states import State, Reason, Outcome

CYCLE = [(State.UNLOADED, State.LOADING), (State.LOADING, State.LOADED), (State.LOADED, State.UNLOADING),
         (State.UNLOADING, State.UNLOADED)]

async def main():
    j = Journal(sys.argv[1], synchronous=sys.argv[2])
    async with trio.open_nursery() as n:
        await n.start(j.run)
        await j.begin_run(os.getpid(), "crash-test", None)
        i = 0
        while True:
            a, b = CYCLE[i % 4]
            j.record(TransitionEvent("m", a, b, Reason.REQUEST, float(i)))
            if b is State.LOADED:
                j.record(LeaseAcquired(f"L{i}", "m", None, None, float(i)))
            if a is State.LOADED:
                j.record(LeaseReleased(f"L{i - 1}", "m", Outcome.COMPLETED, float(i)))
            await j.wait_committed()
            print(j.committed_seq, flush=True)
            i += 1

trio.run(main)
"""


@pytest.mark.parametrize("synchronous", ["full", "normal"])
def test_kill_9_loses_no_acknowledged_row(tmp_path: Path, synchronous: str) -> None:
    """After SIGKILL mid-write, every acknowledged seq is on disk and the next start repairs the rest."""
    path = tmp_path / "j.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), synchronous],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    acked = 0
    try:
        assert proc.stdout is not None
        for _ in range(150):
            acked = int(proc.stdout.readline())
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("SELECT max(seq) FROM events").fetchone()[0] >= acked
    conn.close()

    async def restart() -> tuple[bool, list[str]]:
        async with running(path, begin=False) as j:
            report = await j.begin_run(1, "test", None)
        return report.crashed, check_journal(open_readonly(path))

    crashed, problems = trio.run(restart)
    assert crashed and problems == []
