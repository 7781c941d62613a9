"""Journal retention: what pruning removes and keeps, checkpoints, the gap, vacuum, the writer's slices."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from mlxd.framing import frame
from mlxd.journal import retention
from mlxd.journal.journal import Journal
from mlxd.journal.migrate import migrate, open_database, open_readonly
from mlxd.journal.reads import read_backlog, read_checkpoints, read_transitions
from mlxd.journal.replay import check_journal, replay
from mlxd.journal.retention import Policy, Pruner, file_bytes, used_bytes
from mlxd.journal.rows import Item, encode, plan
from mlxd.journal.writer import Inbox, Settings, Writer
from mlxd.residency.events import LeaseAcquired, LeaseReleased, MeasurementEvent, TransitionEvent
from mlxd.residency.states import Outcome, Reason, State

S = State
DAY = 86400.0
NOW = 2_000_000_000.0
MIB = 1024 * 1024

CYCLE = ((S.UNLOADED, S.LOADING), (S.LOADING, S.LOADED), (S.LOADED, S.UNLOADING),
         (S.UNLOADING, S.UNLOADED))  # fmt: skip


class Fill:
    """Writes events with the writer's own plan into a fresh v2 file, one seq each."""

    def __init__(self, path: Path) -> None:
        self.conn = open_database(path, synchronous="normal")
        migrate(self.conn)
        self.conn.execute("INSERT INTO runs(id, started_at, pid, version) VALUES (1, 0, 1, 't')")
        self.seq = 0
        self.leases = 0

    def write(self, events: list[Any]) -> None:
        items: list[Item] = []
        for e in events:
            self.seq += 1
            items.append((self.seq, 1, encode(e)))
        self.conn.execute("BEGIN IMMEDIATE")
        Writer._write(self.conn, plan(items))
        self.conn.execute("COMMIT")

    def cycle(self, model: str, at: float, leases: int = 2) -> None:
        """One load, ``leases`` leases, one unload of ``model``, starting at ``at``."""
        events: list[Any] = []
        for i, (a, b) in enumerate(CYCLE):
            events.append(TransitionEvent(model, a, b, Reason.REQUEST, at + i))
            if b is S.LOADED:
                events.append(MeasurementEvent(model, at + i, 100, 0.5))
                for _ in range(leases):
                    self.leases += 1
                    lid = f"{model}-{self.leases:06d}"
                    events.append(LeaseAcquired(lid, model, None, "/v1/completions", at + i))
                    events.append(LeaseReleased(lid, model, Outcome.COMPLETED, at + i, 1, 2))
        self.write(events)

    def prune_all(self, pruner: Pruner) -> int:
        slices = 0
        while True:
            self.conn.execute("BEGIN IMMEDIATE")
            done = pruner.slice(self.conn, retention.SLICE_S)
            self.conn.execute("COMMIT")
            if done is None:
                return slices
            slices += 1


def transitions(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    conn.row_factory = None
    return read_transitions(conn, limit=None)


def test_age_pruning_keeps_each_models_latest_transition_and_open_leases(tmp_path: Path) -> None:
    """Rows older than retain_days go, except a model's latest transition and open leases; replay from checkpoints agrees."""
    f = Fill(tmp_path / "j.db")
    old = NOW - 40 * DAY
    for k in range(5):
        f.cycle("a", old + 10 * k)
    f.write([TransitionEvent("b", S.UNLOADED, S.LOADING, Reason.PRELOAD, old + 100),
             TransitionEvent("b", S.LOADING, S.LOADED, Reason.PRELOAD, old + 101),
             LeaseAcquired("held", "b", None, "/v1/completions", old + 102)])  # fmt: skip
    f.cycle("a", NOW - DAY)  # recent: kept
    whole = transitions(f.conn)
    slices = f.prune_all(Pruner(Policy(retain_days=30), clock=lambda: NOW))
    assert slices >= 1
    kept = transitions(f.conn)
    checkpoints = read_checkpoints(f.conn)
    assert replay(kept, checkpoints) == replay(whole)
    # a's recent cycle is whole; b's latest transition stays though it is 40 days old
    assert [(r["model"], r["to_state"]) for r in kept] == [
        ("b", "loaded"), ("a", "loading"), ("a", "loaded"), ("a", "unloading"), ("a", "unloaded"),
    ]  # fmt: skip
    assert checkpoints == {"a": "unloaded", "b": "loading"}
    leases = {r[0] for r in f.conn.execute("SELECT id FROM leases")}
    assert "held" in leases and all(i == "held" or f"{int(i[2:])}" for i in leases)
    assert len(leases) == 1 + 2  # the open lease and the recent cycle's two
    assert f.conn.execute("SELECT count(*) FROM measurements WHERE model = 'a'").fetchone()[0] >= 1
    through, events_pruned = f.conn.execute(
        "SELECT pruned_through, events_pruned FROM retention"
    ).fetchone()
    assert through > 0 and events_pruned > 0
    # nothing newer than the cutoff was touched
    assert f.conn.execute("SELECT min(at) FROM events WHERE seq > ?", (through,)).fetchone()[0] >= NOW - 30 * DAY
    assert check_journal(f.conn) == []


def test_a_latest_transition_kept_below_the_watermark_goes_once_a_newer_one_supersedes_it(
    tmp_path: Path,
) -> None:
    """A transition kept as its model's latest when a slice passed it is pruned once newer ones come: the history replays in order."""
    f = Fill(tmp_path / "j.db")
    policy = Policy(retain_days=30)
    f.cycle("a", NOW - 40 * DAY)
    f.prune_all(Pruner(policy, clock=lambda: NOW))
    kept = transitions(f.conn)
    assert [(r["seq"], r["to_state"]) for r in kept] == [(kept[0]["seq"], "unloaded")]
    f.cycle("a", NOW - 39 * DAY)  # a newer cycle: the kept row is no longer a's latest
    whole = [*kept, *transitions(f.conn)[1:]]
    f.prune_all(Pruner(policy, clock=lambda: NOW))
    left = transitions(f.conn)
    assert [r["to_state"] for r in left] == ["unloaded"] and left[0]["seq"] > kept[0]["seq"]
    assert f.conn.execute(
        "SELECT count(*) FROM events WHERE kind = 'transition'"
    ).fetchone()[0] == 1
    assert replay(left, read_checkpoints(f.conn)) == replay(whole)
    assert check_journal(f.conn) == []


async def test_after_pruning_the_newest_events_a_restart_numbers_rows_past_the_watermark(
    tmp_path: Path,
) -> None:
    """Rows written after a restart number after ``pruned_through`` even when pruning removed the newest events."""
    path = tmp_path / "j.db"
    f = Fill(path)
    for k in range(3):
        f.cycle("a", NOW - 40 * DAY + k * 10)  # each cycle ends with leases after its transitions
    f.write([TransitionEvent("a", S.UNLOADED, S.LOADING, Reason.REQUEST, NOW - 40 * DAY + 50),
             LeaseAcquired("late", "a", None, "/v1/completions", NOW - 40 * DAY + 51),
             LeaseReleased("late", "a", Outcome.COMPLETED, NOW - 40 * DAY + 52, 1, 2)])  # fmt: skip
    f.prune_all(Pruner(Policy(retain_days=30), clock=lambda: NOW))
    through = retention.pruned_through(f.conn)
    kept = f.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
    assert kept < through == f.seq  # the newest rows (the lease's) are gone
    f.conn.close()
    j = Journal(path, synchronous="normal", retain_days=30, wall_clock=lambda: NOW)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        await j.begin_run(2, "t", None)
        # recovery closed a's load as unloaded: load it again
        seq = j.record(TransitionEvent("a", S.UNLOADED, S.LOADING, Reason.REQUEST, NOW))
        await j.wait_committed()
        nursery.cancel_scope.cancel()
    assert seq > through
    conn = open_readonly(path)
    try:
        assert conn.execute("SELECT min(seq) FROM events WHERE run_id = 2").fetchone()[0] > through
        assert check_journal(conn) == []
    finally:
        conn.close()


def test_a_resume_from_a_pruned_id_gets_a_gap_event_with_every_models_state(tmp_path: Path) -> None:
    """Resuming from an id older than the oldest kept row answers a gap first, then the events after it."""
    f = Fill(tmp_path / "j.db")
    for k in range(4):
        f.cycle("a" if k % 2 else "b", NOW - 40 * DAY + k * 10)
    f.cycle("a", NOW)
    f.prune_all(Pruner(Policy(retain_days=30), clock=lambda: NOW))
    through = retention.pruned_through(f.conn)
    gap, rows = read_backlog(f.conn, 3)
    assert gap is not None and gap["kind"] == "gap"
    assert (gap["after"], gap["through"]) == (3, through)
    assert gap["states"] == {"a": "unloaded", "b": "unloaded"}
    assert rows and rows[0]["seq"] > through
    assert read_backlog(f.conn, through) == (None, rows)  # from the watermark on: no gap


def test_size_pruning_gets_under_max_mb_and_incremental_vacuum_shrinks_the_file(
    tmp_path: Path,
) -> None:
    """Over max_mb, the oldest rows go until the pages in use are under the target, and the file shrinks."""
    f = Fill(tmp_path / "j.db")
    for k in range(300):
        f.cycle("abc"[k % 3], NOW + k, leases=10)
    before = file_bytes(f.conn)
    assert before > 1.5 * MIB
    policy = Policy(max_bytes=1 * MIB)
    f.prune_all(Pruner(policy, clock=lambda: NOW))
    assert used_bytes(f.conn) <= policy.target_bytes
    assert file_bytes(f.conn) <= policy.max_bytes < before
    assert check_journal(f.conn) == []
    f.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert os.path.getsize(tmp_path / "j.db") <= policy.max_bytes


def test_slices_adapt_to_their_time_budget(tmp_path: Path) -> None:
    """A slice that overran its budget halves the next batch; a quick one grows it."""
    f = Fill(tmp_path / "j.db")
    for k in range(20):
        f.cycle("a", NOW - 40 * DAY + k * 10)
    ticks = iter([0.0, 0.05, 0.05, 0.05, 1.0, 1.0001, 1.0001, 1.0001])
    pruner = Pruner(Policy(retain_days=1), clock=lambda: NOW, timer=lambda: next(ticks))
    pruner.batch = 64
    f.conn.execute("BEGIN IMMEDIATE")
    assert pruner.slice(f.conn, 0.01) is not None
    assert pruner.batch == 32
    assert pruner.slice(f.conn, 0.01) is not None
    assert pruner.batch == 48
    f.conn.execute("COMMIT")


def test_when_only_unprunable_rows_are_left_it_rests_and_says_so(tmp_path: Path) -> None:
    """Over max_mb with nothing prunable left, the pruner says so once and rests instead of spinning."""
    f = Fill(tmp_path / "j.db")
    f.cycle("a", NOW)
    pruner = Pruner(Policy(max_bytes=1024), clock=lambda: NOW)
    f.prune_all(pruner)
    assert pruner.note is not None and "never pruned" in pruner.note
    assert not pruner.due(f.conn)
    assert [r["to_state"] for r in transitions(f.conn)] == ["unloaded"]


class Clock:
    """A timer that moves only when told (a slice or a live batch "takes" time)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_slice_waits_for_live_records_unless_pruning_is_behind(tmp_path: Path) -> None:
    """With records always waiting, slices run only once pruning is behind, then at most BUSY_SHARE of the time."""
    f = Fill(tmp_path / "j.db")
    for k in range(100):
        f.cycle("a", NOW - 40 * DAY + k * 10, leases=5)
    clock = Clock()
    pruner = Pruner(Policy(retain_days=30), clock=lambda: NOW, timer=clock)
    real_slice = pruner.slice

    def slice_taking_its_budget(conn: sqlite3.Connection, budget_s: float) -> Any:
        clock.now += budget_s
        pruner.batch = retention.MIN_BATCH  # many slices
        return real_slice(conn, budget_s)

    pruner.slice = slice_taking_its_budget  # type: ignore[method-assign]
    assert pruner.due(f.conn) and pruner.may_run(waiting=False)  # idle: at once
    pruner.alone(f.conn)  # the last idle moment; from now on records always wait
    idle_end = clock.now
    slices: list[float] = []
    while pruner.due(f.conn) and clock.now < 60:
        if pruner.may_run(waiting=True):
            slices.append(clock.now)
            pruner.alone(f.conn, busy=True)
        else:
            clock.now += 0.010  # a live batch is written instead
    assert slices and slices[0] >= idle_end + retention.BEHIND_S  # only once starved that long
    assert retention.pruned_through(f.conn) > 0 and not pruner.due(f.conn)  # it finished
    # their time: the share of the time since they began, plus at most one slice of credit
    # saved up before and one overdrawn at the end
    busy = clock.now - slices[0]
    assert len(slices) > 50
    assert retention.SLICE_S * len(slices) <= retention.BUSY_SHARE * busy + 2 * retention.SLICE_S


def test_the_writer_commits_arriving_records_before_its_next_slice(tmp_path: Path) -> None:
    """Records that arrive during a slice are committed before the next one, in a batch that prunes nothing."""
    path = tmp_path / "j.db"
    f = Fill(path)
    for k in range(20):
        f.cycle("a", NOW - 40 * DAY + k * 10)
    first = f.seq + 1
    f.conn.close()
    r, w = os.pipe()

    def records(seq: int, lid: str) -> None:
        events = [LeaseAcquired(lid, "a", None, "/v1/completions", NOW),
                  LeaseReleased(lid, "a", Outcome.COMPLETED, NOW, 1, 2)]  # fmt: skip
        os.write(w, frame(("records", seq, 1, [encode(e) for e in events])))

    log: list[tuple[str, int]] = []

    def send(message: tuple[Any, ...]) -> None:
        if message[0] == "batch":
            log.append(("batch", retention.pruned_through(reader)))
            if message[1] == first + 3:
                os.write(w, frame(("stop",)))

    settings = Settings(str(path), "normal", 5000, 0.1, 1.0, None, os.getpid(), retain_days=30)
    writer = Writer(settings, send)
    # a timer that never moves: pruning is never behind, so it never runs ahead of live records
    pruner = writer.pruner = Pruner(Policy(retain_days=30), clock=lambda: NOW, timer=lambda: 0.0)
    pruner.batch = retention.MIN_BATCH
    real_slice = pruner.slice

    def slice_logged(conn: sqlite3.Connection, budget_s: float) -> Any:
        done = real_slice(conn, budget_s)
        log.append(("slice", done.through if done else 0))
        if len(log) == 3:
            records(first + 2, "late")  # arrives during the second slice
        return done

    pruner.slice = slice_logged  # type: ignore[method-assign]
    records(first, "early")  # waiting when the writer starts, pruning already due
    reader = open_readonly(path)
    try:
        writer.run(Inbox(r))
    finally:
        reader.close()
        os.close(r)
        os.close(w)
    assert [kind for kind, _ in log] == ["batch", "slice", "slice", "batch"]
    assert log[0][1] == 0  # the first batch committed before any pruning, and pruned nothing
    assert log[3][1] == log[2][1] > 0  # the late batch after the slice it arrived in, pruning nothing


async def test_the_writer_keeps_a_busy_journal_under_max_mb(tmp_path: Path) -> None:
    """The real writer process prunes while records flow: the file stays under max_mb and replays right."""
    path = tmp_path / "j.db"
    j = Journal(path, synchronous="normal", max_mb=1, wall_clock=time.time)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        await j.begin_run(1, "t", None)
        j.record(TransitionEvent("a", S.UNLOADED, S.LOADING, Reason.REQUEST, time.time()))
        j.record(TransitionEvent("a", S.LOADING, S.LOADED, Reason.REQUEST, time.time()))
        for burst in range(40):
            for i in range(250):
                lid = f"{burst:04d}{i:06d}"
                j.record(LeaseAcquired(lid, "a", None, "/v1/completions", time.time()))
                j.record(LeaseReleased(lid, "a", Outcome.COMPLETED, time.time(), 3, 4))
            await j.wait_committed()
        # idle now: standalone slices finish the job
        with trio.fail_after(30):
            while _sizes(path)[0] > 1 * MIB:  # noqa: ASYNC110 (a file size has no event)
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    conn = open_readonly(path)
    try:
        assert check_journal(conn) == []
        assert conn.execute("SELECT pruned_through FROM retention").fetchone()[0] > 0
        assert [tuple(r) for r in conn.execute("SELECT model, to_state FROM transitions")] == [
            ("a", "loaded")
        ]
        assert used_bytes(conn) <= 1 * MIB
    finally:
        conn.close()


def _sizes(path: Path) -> tuple[int, int]:
    wal = Path(str(path) + "-wal")
    return path.stat().st_size, wal.stat().st_size if wal.exists() else 0


@pytest.mark.parametrize("bad", [-1, "x", None])
def test_config_rejects_bad_retention_values(tmp_path: Path, bad: object) -> None:
    """journal.retain_days and journal.max_mb are numbers >= 0 (0 = no limit); anything else names the key."""
    from mlxd.config import load_config
    from mlxd.errors import ConfigError

    for key in ("retain_days", "max_mb"):
        cfg = tmp_path / f"{key}.yaml"
        cfg.write_text(
            f"journal: {{{key}: {bad if bad is not None else 'null'}}}\n"
            "manager: {memory_budget_gb: 1}\nmodels: []\n"
        )
        with pytest.raises(ConfigError, match=f"journal.{key}"):
            load_config(cfg)
