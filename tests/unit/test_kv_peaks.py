"""KV peaks in the journal (schema v4): the migration, the rows, retention, check-config, fakes."""

from __future__ import annotations

import os
import shutil
import sqlite3
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import trio

from mlxd import cli
from mlxd.config import Config, FakeSettings, JournalConfig, ManagerConfig, ModelConfig
from mlxd.engines.fake import FakeFleet
from mlxd.journal import retention
from mlxd.journal.journal import Journal
from mlxd.journal.migrate import discover, migrate, open_database, open_readonly
from mlxd.journal.reads import KvPeaks, journal_kv_peaks
from mlxd.journal.replay import check_journal
from mlxd.journal.rows import Item, decode, encode, plan, prepare
from mlxd.journal.writer import Settings, Writer
from mlxd.residency.events import KvPeakEvent, MeasurementEvent, TransitionEvent
from mlxd.residency.manager import Manager
from mlxd.residency.states import Reason, State
from mlxd.units import GIB, MIB
from tests.support.old_journal import write_v1_journal

from .test_retention import DAY, NOW, Fill

KV_COLUMNS = (
    "model, at, run_id, loaded_at, kv_peak_bytes, kv_budget_bytes, prompt_cache_bytes,"
    " prompt_cache_budget_bytes"
)


def peak(model: str, at: float, used: int, budget: int = 100, cached: int = 5) -> KvPeakEvent:
    return KvPeakEvent(model, at, at - 50, used, budget, cached, 10)


def kv_rows(conn: sqlite3.Connection) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.execute(f"SELECT {KV_COLUMNS} FROM kv_peaks ORDER BY at")]


# ---- the migration -----------------------------------------------------------------------------


def _tables(conn: sqlite3.Connection) -> dict[str, list[tuple[Any, ...]]]:
    names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    return {t: [tuple(r) for r in conn.execute(f"SELECT * FROM {t} ORDER BY rowid")] for t in names}


def test_0004_keeps_every_row_of_a_v3_journal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0003 -> 0004 on a journal full of history keeps every row of every table, and only adds."""
    path = tmp_path / "journal.db"
    write_v1_journal(path, 5_000)
    v3 = tmp_path / "v3"
    v3.mkdir()
    for m in discover()[:3]:
        shutil.copy(m.path, v3 / m.path.name)
    conn = open_database(path)
    assert migrate(conn, v3) == (1, 3)
    conn.execute("INSERT INTO measurement_weights SELECT model, at, 'w-' || model FROM measurements")
    conn.execute("UPDATE retention SET measurements_pruned = 7, events_pruned = 11")
    before = _tables(conn)
    conn.close()
    assert cli.main(["migrate", "--journal", str(path)]) == 0
    latest = len(discover())  # 0004 and any migration after it
    assert f"migrated from v3 to v{latest}" in capsys.readouterr().out
    conn = open_readonly(path)
    try:
        after = _tables(conn)
        assert conn.execute("PRAGMA user_version").fetchone()[0] == latest
        assert check_journal(conn) == []
    finally:
        conn.close()
    assert set(after) >= {*before, "kv_peaks"} and after["kv_peaks"] == []
    assert all(after[t] == [] for t in set(after) - set(before))  # later migrations only add
    assert sum(len(rows) for rows in before.values()) > 5_000
    for table, rows in before.items():
        width = len(rows[0]) if rows else 0
        if table == "retention":  # counters added at the end, 0 so far
            assert [r[:width] for r in after[table]] == rows and set(after[table][0][width:]) == {0}
        elif table == "leases":  # kv_wait_seconds (v6) added at the end, NULL on old rows
            assert [r[:width] for r in after[table]] == rows
            assert {r[width:] for r in after[table]} == {(None,)}
        else:
            assert after[table] == rows, table


# ---- the rows ------------------------------------------------------------------------------


def _v4(path: Path) -> sqlite3.Connection:
    conn = open_database(path, synchronous="normal")
    migrate(conn)
    conn.execute("INSERT INTO runs(id, started_at, pid, version) VALUES (1, 0, 1, 't')")
    return conn


def test_a_kv_peak_is_one_row_in_a_batch_and_record_by_record(tmp_path: Path) -> None:
    """decode(encode(e)) == e; a batch's plan and the record-by-record path write the same kv_peaks rows, no events row."""
    events = [
        TransitionEvent("a", State.UNLOADED, State.LOADING, Reason.REQUEST, 1.0),
        MeasurementEvent("a", 2.0, 10, 0.5),
        KvPeakEvent("a", 3.0, 2.0, 4096, 8192, 512, 1024),
        KvPeakEvent("b", 4.0, 3.5, 0, 0, 0, 0),
    ]
    assert [decode(encode(e)) for e in events] == events
    items: list[Item] = [(i + 1, 1, encode(e)) for i, e in enumerate(events)]
    batched, one_by_one = _v4(tmp_path / "a.db"), _v4(tmp_path / "b.db")
    Writer._write(batched, plan(items))
    for item in items:
        Writer._apply(one_by_one, prepare(item))
    expected = [("a", 3.0, 1, 2.0, 4096, 8192, 512, 1024), ("b", 4.0, 1, 3.5, 0, 0, 0, 0)]
    assert kv_rows(batched) == kv_rows(one_by_one) == expected
    assert batched.execute("SELECT count(*) FROM events").fetchone() == (1,)  # the transition's


def test_a_replayed_kv_peak_is_not_written_twice(tmp_path: Path) -> None:
    """A KV peak a dead writer committed but never confirmed comes again after replay_until and is not inserted twice."""
    settings = Settings(str(tmp_path / "j.db"), "normal", 1000, 0.01, 0.1, None, os.getpid())
    writer = Writer(settings, [].append)
    conn = writer._open()
    run_id = conn.execute("INSERT INTO runs(started_at, pid, version) VALUES (1, 1, 't')").lastrowid
    assert run_id is not None
    first, later = encode(peak("m", 1.5, 40)), encode(peak("m", 2.5, 60))
    writer._commit(conn, [(1, run_id, first)])
    writer._take([("replay_until", 2)], type("Inbox", (), {"closed": False})())  # type: ignore[arg-type]
    writer._commit(conn, [(1, run_id, first), (2, run_id, later)])
    assert [r[:5] for r in kv_rows(conn)] == [("m", 1.5, run_id, 1.5 - 50, 40), ("m", 2.5, run_id, 2.5 - 50, 60)]
    conn.close()
    writer._release_lock()


# ---- retention -----------------------------------------------------------------------------


def test_retention_prunes_old_kv_peaks_but_keeps_each_models_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pruning by age takes kv_peaks older than the cutoff with the measurements, except each model's latest, and counts them."""
    monkeypatch.setattr(retention, "MEASUREMENTS_EVERY", 1)  # measurements and peaks every slice
    f = Fill(tmp_path / "j.db")
    old = NOW - 40 * DAY
    for k in range(4):
        f.cycle("a", old + 10 * k)
        f.write([peak("a", old + 10 * k + 3, 10 + k)])
    f.cycle("b", old + 100)
    f.write([peak("b", old + 103, 99)])  # b's only peak: old, but its latest
    f.cycle("a", NOW - DAY)
    f.write([peak("a", NOW - DAY + 3, 77)])
    assert f.prune_all(retention.Pruner(retention.Policy(retain_days=30), clock=lambda: NOW)) >= 1
    kept = [(r[0], r[4]) for r in kv_rows(f.conn)]
    assert kept == [("b", 99), ("a", 77)]
    pruned = f.conn.execute("SELECT kv_peaks_pruned, measurements_pruned FROM retention").fetchone()
    assert pruned == (4, 4)
    assert check_journal(f.conn) == []


# ---- reading them back: check-config -------------------------------------------------------------


def test_check_config_prints_the_measured_peak_under_the_kv_cache_it_budgets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """check-config shows each model's highest journaled peak against today's kv_cache, and the latest."""
    journal = tmp_path / "journal.db"
    conn = _v4(journal)
    day = datetime(2026, 11, 30, 9, 0).timestamp()
    for at, used, budget in ((day, 64 * MIB, 256 * MIB), (day + 3600, 128 * MIB, 512 * MIB),
                             (day + 7200, 32 * MIB, 512 * MIB)):  # fmt: skip
        Writer._apply(conn, prepare((1, 1, encode(peak("q", at, used, budget)))))
    conn.close()
    assert journal_kv_peaks(JournalConfig(journal)) == {
        "q": KvPeaks(3, 128 * MIB, 512 * MIB, 32 * MIB, 512 * MIB, day + 7200, day)
    }
    cfg = tmp_path / "m.yaml"
    cfg.write_text(
        f"journal: {{path: {journal}}}\nmanager: {{memory_budget_gb: 8}}\nmodels:\n"
        "  - {name: q, path: mlx-community/Qwen2.5-0.5B-Instruct-4bit, estimated_memory_gb: 1,"
        " kv_cache_gb: 0.5, prompt_cache_gb: 0.1}\n"
        "  - {name: f, engine: fake, estimated_memory_gb: 1}\n"
    )
    assert cli.main(["check-config", str(cfg)]) == 0
    lines = capsys.readouterr().out.splitlines()
    commits = next(i for i, line in enumerate(lines) if "commits" in line and "KV cache 512.0 MiB" in line)
    assert lines[commits + 1] == (
        "      KV measured: peak 128.0 MiB (25% of its 512.0 MiB) in 3 residencies since 2026-11-30 09:00;"
        " the latest 32.0 MiB (2026-11-30 11:00)"
    )
    assert sum("KV measured" in line for line in lines) == 1  # the fake has none


def test_a_journal_before_v4_has_no_kv_peaks(tmp_path: Path) -> None:
    """A file not migrated to v4 (read-only readers never migrate), or none at all, reads as no peaks."""
    path = tmp_path / "v3.db"
    con = sqlite3.connect(path)
    for m in discover()[:3]:
        con.executescript(m.path.read_text())
    con.close()
    assert journal_kv_peaks(JournalConfig(path)) == {}
    assert journal_kv_peaks(JournalConfig(tmp_path / "missing.db")) == {}


# ---- the manager: only engines that measure KV write peaks -----------------------------------


async def test_a_fake_engine_that_reports_no_kv_journals_no_peak(tmp_path: Path) -> None:
    """A fake model loaded, leased, unloaded, loaded again and shut down journals its measurements but no kv_peaks row."""
    fake = FakeSettings(load_seconds=0.0, memory_bytes=GIB)
    model = ModelConfig(name="f", source="fake:f", engine="fake", fake=fake)
    manager = Manager(Config(manager=ManagerConfig(memory_budget_bytes=8 * GIB), models=(model,)),
                      FakeFleet())  # fmt: skip
    journal = Journal(tmp_path / "journal.db")
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await journal.begin_run(os.getpid(), "test", None)
        manager.subscribe(journal.record)
        await nursery.start(manager.run)
        async with manager.lease("f"):
            pass
        await manager.unload("f")
        await manager.load("f")
        assert await manager.shutdown(1.0)
        await journal.wait_committed()
        conn = open_readonly(journal.path)
        try:
            assert conn.execute("SELECT count(*) FROM measurements").fetchone()[0] == 2
            assert conn.execute("SELECT count(*) FROM transitions WHERE to_state = 'unloaded'").fetchone()[0] == 2
            assert kv_rows(conn) == []
        finally:
            conn.close()
        nursery.cancel_scope.cancel()
