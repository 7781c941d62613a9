"""`mlxd history` and the documented sqlite3 queries, on a journal filled by the real writer."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import trio

from mlxd import cli
from mlxd.errors import ConfigError
from mlxd.journal.journal import Journal
from mlxd.journal.migrate import open_readonly
from mlxd.journal.reads import LEASE_COLUMNS, TRANSITION_COLUMNS, parse_since
from mlxd.journal.replay import check_journal
from mlxd.residency.events import (
    KvPeakEvent,
    LeaseAcquired,
    LeaseReleased,
    MeasurementEvent,
    TransitionEvent,
)
from mlxd.residency.states import Outcome, Reason, State
from mlxd.units import MIB

REPO = Path(__file__).resolve().parents[2]

DAY1 = datetime(2026, 11, 27, 10, 0).timestamp()  # local 10:00
DAY2 = DAY1 + 86400


def local_day(at: float) -> str:
    return datetime.fromtimestamp(at).date().isoformat()


def load(
    model: str, at: float, reason: Reason = Reason.REQUEST, mib: int = 500
) -> list[TransitionEvent]:
    return [
        TransitionEvent(model, State.UNLOADED, State.LOADING, reason, at),
        TransitionEvent(model, State.LOADING, State.LOADED, reason, at + 2, memory_bytes=mib * MIB),
    ]


def evict_idle(model: str, at: float) -> list[TransitionEvent]:
    return [
        TransitionEvent(model, State.LOADED, State.UNLOADING, Reason.EVICTED, at),
        TransitionEvent(model, State.UNLOADING, State.UNLOADED, Reason.EVICTED, at + 1),
    ]


def lease(
    lid: str, model: str, at: float, held: float, outcome: Outcome, tokens: int,
    client: str | None = None,
) -> list[Any]:  # fmt: skip
    return [
        LeaseAcquired(lid, model, f"req-{lid}", "/v1/chat/completions", at, client),
        LeaseReleased(lid, model, outcome, at + held, 5, tokens, held),
    ]


async def _fill(path: Path) -> None:
    async def run(events: list[Any], wall: float, clean: bool | None) -> None:
        j = Journal(path, wall_clock=lambda: wall)
        async with trio.open_nursery() as n:
            await n.start(j.run)
            await j.begin_run(100, "test", None)
            for e in events:
                j.record(e)
            if clean is not None:
                j.end_run(clean)
            await j.wait_committed()
            n.cancel_scope.cancel()

    # run 1 dies with qwen loaded and a lease open
    await run(
        [
            *load("qwen", DAY1 - 3600),
            MeasurementEvent("qwen", DAY1 - 3598, 500 * MIB, 2.0),
            LeaseAcquired("lost", "qwen", "req-lost", "/v1/completions", DAY1 - 3500),
        ],
        DAY1 - 7200,
        None,
    )
    # run 2: restore, evictions, preemptions, an open lease
    await run(
        [
            *load("qwen", DAY1, Reason.RESTORE, mib=600),
            MeasurementEvent("qwen", DAY1 + 2, 600 * MIB, 4.0, "qwen-weights-1"),
            *load("llama", DAY1 + 100),
            MeasurementEvent("llama", DAY1 + 102, 300 * MIB, 1.0),
            *lease("p1", "llama", DAY1 + 200, 2.0, Outcome.PREEMPTED, 10, "laptop"),
            *lease("p2", "llama", DAY1 + 300, 4.0, Outcome.PREEMPTED, 20, "laptop"),
            *lease("ok", "qwen", DAY1 + 400, 1.0, Outcome.COMPLETED, 50, "ops"),
            *evict_idle("qwen", DAY1 + 500),
            KvPeakEvent("qwen", DAY1 + 500, DAY1 + 2, 30 * MIB, 100 * MIB, 5 * MIB, 50 * MIB),
            TransitionEvent("llama", State.LOADED, State.DRAINING, Reason.EVICTED, DAY1 + 600),
            TransitionEvent("llama", State.DRAINING, State.UNLOADING, Reason.EVICTED, DAY1 + 601),
            KvPeakEvent("llama", DAY1 + 601, DAY1 + 102, 10 * MIB, 40 * MIB, 0, 0),
            KvPeakEvent("llama", DAY1 + 601.5, DAY1 + 102, 0, 0, 0, 0),  # no budget: left out
            TransitionEvent("llama", State.UNLOADING, State.UNLOADED, Reason.EVICTED, DAY1 + 602),
            *load("qwen", DAY2),
            MeasurementEvent("qwen", DAY2 + 2, 550 * MIB, 3.0, "qwen-weights-2"),
            *lease("p3", "qwen", DAY2 + 100, 3.0, Outcome.PREEMPTED, 7, "laptop"),
            *evict_idle("qwen", DAY2 + 200),
            KvPeakEvent("qwen", DAY2 + 200, DAY2 + 2, 80 * MIB, 100 * MIB, 9 * MIB, 50 * MIB),
            *load("qwen", DAY2 + 300),
            LeaseAcquired(
                "open-now", "qwen", "req-open", "/v1/chat/completions", time.time() - 60, "laptop"
            ),
        ],
        DAY1 - 60,
        None,
    )


@pytest.fixture
async def journal(tmp_path: Path) -> Path:
    """A journal the real writer filled: a crashed run, then evictions, preemptions, an open lease."""
    path = tmp_path / "journal.db"
    await _fill(path)
    return path


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def history(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["history", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_parse_since_durations_and_iso_times() -> None:
    """--since takes 90s/15m/2h/7d ago, local ISO times and ISO times with an offset."""
    now = 1_800_000_000.0
    assert parse_since("90s", now=now) == now - 90
    assert parse_since("15m", now=now) == now - 900
    assert parse_since("2h", now=now) == now - 7200
    assert parse_since("1.5h", now=now) == now - 5400
    assert parse_since("7d", now=now) == now - 7 * 86400
    assert parse_since("2026-11-29T10:00") == datetime(2026, 11, 29, 10, 0).timestamp()
    assert parse_since("2026-11-29 10:00:30") == datetime(2026, 11, 29, 10, 0, 30).timestamp()
    utc = datetime(2026, 11, 29, 10, 0, tzinfo=UTC).timestamp()
    assert parse_since("2026-11-29T10:00:00+00:00") == utc
    assert parse_since("2026-11-29T10:00:00Z") == utc
    assert parse_since("2026-11-29T12:00:00+02:00") == utc
    for bad in ("yesterday", "10x", "", "-5m", "2026-13-01"):
        with pytest.raises(ConfigError, match="--since"):
            parse_since(bad)


async def test_json_has_the_journals_columns(
    journal: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json prints a JSON array of transition rows keyed by the journal's columns, oldest first."""
    code, out, _ = history(capsys, "--journal", str(journal), "--json", "--limit", "0")
    assert code == 0
    rows = json.loads(out)
    assert all(tuple(r) == TRANSITION_COLUMNS for r in rows)
    seqs = [r["seq"] for r in rows]
    assert seqs == sorted(seqs) and len(rows) == 18
    assert rows[0] == {
        "seq": 1, "run_id": 1, "at": DAY1 - 3600, "model": "qwen", "from_state": "unloaded",
        "to_state": "loading", "reason": "request", "memory_bytes": None, "error": None,
    }  # fmt: skip
    recovery = [r for r in rows if r["reason"] == "crash_recovery"]
    assert [(r["model"], r["from_state"], r["run_id"]) for r in recovery] == [("qwen", "loaded", 2)]
    assert check_journal(open_readonly(journal)) == []


async def test_filters_model_since_limit(journal: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--model, --since and --limit select rows; --limit keeps the most recent ones."""
    _, out, _ = history(capsys, "--journal", str(journal), "--json", "--model", "llama")
    rows = json.loads(out)
    assert {r["model"] for r in rows} == {"llama"} and len(rows) == 5
    day2 = datetime.fromtimestamp(DAY2).strftime("%Y-%m-%dT%H:%M")
    _, out, _ = history(capsys, "--journal", str(journal), "--json", "--since", day2)
    assert {r["at"] >= DAY2 for r in json.loads(out)} == {True} and len(json.loads(out)) == 6
    _, out, _ = history(capsys, "--journal", str(journal), "--json", "--limit", "2")
    assert [(r["from_state"], r["to_state"]) for r in json.loads(out)] == [
        ("unloaded", "loading"), ("loading", "loaded"),
    ]  # fmt: skip
    _, out, _ = history(capsys, "--journal", str(journal), "--json")
    assert len(json.loads(out)) == 18  # under the default limit of 50


async def test_leases_json_and_since_duration(
    journal: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--leases --json prints lease rows with the journal's columns; --since 1h keeps the recent one."""
    _, out, _ = history(capsys, "--journal", str(journal), "--leases", "--json", "--limit", "0")
    rows = json.loads(out)
    assert all(tuple(r) == LEASE_COLUMNS for r in rows)
    assert {r["id"]: r["outcome"] for r in rows} == {
        "lost": "interrupted", "p1": "preempted", "p2": "preempted", "ok": "completed",
        "p3": "preempted", "open-now": None,
    }  # fmt: skip
    _, out, _ = history(capsys, "--journal", str(journal), "--leases", "--json", "--since", "1h")
    assert [r["id"] for r in json.loads(out)] == ["open-now"]


async def test_table_output_uses_local_times(
    journal: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --json the rows print as an aligned table with local times and sizes."""
    code, out, _ = history(capsys, "--journal", str(journal), "--model", "llama")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "time",
        "seq",
        "run",
        "model",
        "transition",
        "reason",
        "memory",
        "error",
    ]
    local = datetime.fromtimestamp(DAY1 + 102).strftime("%Y-%m-%d %H:%M:%S.000")
    assert any(
        line.startswith(local) and "loading -> loaded" in line and "500.0 MiB" in line
        for line in lines
    )
    _, out, _ = history(capsys, "--journal", str(journal), "--leases", "--model", "llama")
    assert "2.00s" in out and "preempted" in out and "5+10" in out
    _, out, _ = history(capsys, "--journal", str(journal), "--model", "nobody")
    assert out.strip() == "no rows"


async def test_config_path_and_read_only(
    journal: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--config reads the config's journal.path, and reading leaves the journal file untouched."""
    config = tmp_path / "mlxd.yaml"
    config.write_text(
        f"journal: {{path: {journal.name}}}\nmanager: {{memory_budget_gb: 1}}\n"
        "models:\n  - {name: f, engine: fake, path: org/fake, estimated_memory_gb: 0.1}\n"
    )
    digest = _digest(journal)
    code, out, _ = history(
        capsys, "--config", str(config), "--json", "--model", "llama", "--limit", "1"
    )
    assert code == 0 and json.loads(out)[0]["to_state"] == "unloaded"
    assert _digest(journal) == digest


def test_errors_are_one_line_with_the_right_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing file exits 1, a bad --since or --limit exits 2, each with one line on stderr."""
    missing = tmp_path / "none.db"
    code, out, err = history(capsys, "--journal", str(missing))
    assert (code, out) == (1, "") and err == f"mlxd: journal: no journal file at {missing}\n"
    assert not missing.exists()
    code, _, err = history(capsys, "--journal", str(missing), "--since", "soon")
    assert code == 2 and err.count("\n") == 1 and "--since" in err
    code, _, err = history(capsys, "--journal", str(missing), "--limit", "-1")
    assert code == 2 and err.count("\n") == 1 and "--limit" in err


async def test_verify_passes_a_sound_journal(
    journal: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--verify exits 0 on a journal whose every path is legal, and says how much it checked."""
    digest = _digest(journal)
    code, out, err = history(capsys, "--journal", str(journal), "--verify")
    assert (code, err) == (0, "")
    assert out == f"{journal}: sound: 18 transitions over 2 runs, every path legal\n"
    code, out, _ = history(capsys, "--journal", str(journal), "--verify", "--json")
    assert code == 0 and json.loads(out) == {"ok": True, "transitions": 18, "runs": 2, "problems": []}
    assert _digest(journal) == digest  # verifying never writes


async def test_verify_fails_on_an_illegal_path(
    journal: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--verify exits 1 and names the row when a model's journal is not a path through the table."""
    conn = sqlite3.connect(journal)
    with conn:
        (seq,) = conn.execute("SELECT max(seq) + 1 FROM events").fetchone()
        conn.execute("INSERT INTO events VALUES (?, 2, 0, 'transition', 'llama', '{}')", (seq,))
        conn.execute(
            "INSERT INTO transitions VALUES (?, 2, 0, 'llama', 'unloaded', 'loaded', 'request', NULL, NULL)",
            (seq,),
        )
    conn.close()
    code, out, _ = history(capsys, "--journal", str(journal), "--verify")
    assert code == 1
    assert out == f"{journal}: seq {seq} llama: unloaded -> loaded (request) is not a legal move\n"
    code, out, _ = history(capsys, "--journal", str(journal), "--verify", "--json")
    assert code == 1 and json.loads(out)["ok"] is False


# ---- docs/journal.md: every query runs on a real journal ----------------------------------

DOC = REPO / "docs" / "journal.md"


def doc_queries() -> list[str]:
    return re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.S)


def run_query(journal: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = open_readonly(journal)
    try:
        return [tuple(r) for r in conn.execute(sql).fetchall()]
    finally:
        conn.close()


def test_docs_have_nine_queries() -> None:
    """docs/journal.md documents exactly the nine tested queries."""
    assert len(doc_queries()) == 9


async def test_doc_query_what_evictions_were_for(journal: Path) -> None:
    """Query 9 lists evictions and preemptions newest first with their cause column."""
    rows = run_query(journal, doc_queries()[8])
    assert rows and all(len(r) == 4 for r in rows)
    assert all(r[2] in ("unloading", "draining") for r in rows)


async def test_doc_query_recent_transitions(journal: Path) -> None:
    """Query 1 lists a model's transitions newest first with local times."""
    rows = run_query(journal, doc_queries()[0])
    assert len(rows) == 13 and [r[0] for r in rows] == sorted((r[0] for r in rows), reverse=True)
    _, time_, transition, reason, mib, error = rows[0]
    assert (transition, reason, mib, error) == ("loading -> loaded", "request", 500.0, None)
    assert time_ == datetime.fromtimestamp(DAY2 + 302).strftime("%Y-%m-%d %H:%M:%S")
    assert ("loaded -> unloaded", "crash_recovery") in {(r[2], r[3]) for r in rows}


async def test_doc_query_evictions_per_day(journal: Path) -> None:
    """Query 2 counts each eviction once per day and model, busy or idle."""
    assert run_query(journal, doc_queries()[1]) == [
        (local_day(DAY1), "llama", 1),
        (local_day(DAY1), "qwen", 1),
        (local_day(DAY2), "qwen", 1),
    ]


async def test_doc_query_preemptions(journal: Path) -> None:
    """Query 3 counts preempted leases per day and model with their average hold and lost tokens."""
    assert run_query(journal, doc_queries()[2]) == [
        (local_day(DAY1), "llama", 2, 3.0, 30),
        (local_day(DAY2), "qwen", 1, 3.0, 7),
    ]


async def test_doc_query_open_leases(journal: Path) -> None:
    """Query 4 lists the leases open in the newest run, not the ones recovery closed."""
    (row,) = run_query(journal, doc_queries()[3])
    assert row[:4] == ("open-now", "qwen", "/v1/chat/completions", "req-open")
    assert 59 <= row[5] < 3600


async def test_doc_query_load_time_trend(journal: Path) -> None:
    """Query 5 summarises load times and memory per model and day."""
    assert run_query(journal, doc_queries()[4]) == [
        ("llama", local_day(DAY1), 1, 1.0, 1.0, 300.0),
        ("qwen", local_day(DAY1), 2, 3.0, 4.0, 600.0),  # 09:00 and 10:00 the same day
        ("qwen", local_day(DAY2), 1, 3.0, 3.0, 550.0),
    ]


async def test_doc_query_measurements_and_their_weights(journal: Path) -> None:
    """Query 6 gives each model's latest measurement with its weights' fingerprint (NULL before v3)."""
    at = lambda t: datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")  # noqa: E731
    assert run_query(journal, doc_queries()[5]) == [
        ("llama", at(DAY1 + 102), 300.0, None),
        ("qwen", at(DAY2 + 2), 550.0, "qwen-weights-2"),
    ]


async def test_doc_query_requests_per_client(journal: Path) -> None:
    """Query 7 counts each client's requests, tokens and models per day ('-' for no key)."""
    rows = run_query(journal, doc_queries()[6])
    got = {(day, client): rest for day, client, *rest in rows}
    today = local_day(time.time() - 60)  # the lease still open
    expected = {
        (local_day(DAY1), "laptop"): [2, 10, 30, 1],
        (local_day(DAY1), "ops"): [1, 5, 50, 1],
        (local_day(DAY1), "-"): [1, 0, 0, 1],  # before keys: interrupted, no tokens
        (local_day(DAY2), "laptop"): [1, 5, 7, 1],
    }
    if (today, "laptop") in expected:
        expected[(today, "laptop")][0] += 1
    else:
        expected[(today, "laptop")] = [1, 0, 0, 1]
    assert got == {k: v for k, v in expected.items()}
    assert [(d, c) for d, c, *_ in rows] == sorted(
        got, key=lambda k: (k[0], -got[k][0], k[1])
    )


async def test_history_filters_leases_by_client(
    journal: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--client NAME prints the leases of that key's name only, as a table or JSON."""
    _, out, _ = history(capsys, "--journal", str(journal), "--client", "laptop", "--json", "--limit", "0")
    assert [r["id"] for r in json.loads(out)] == ["p1", "p2", "p3", "open-now"]
    assert {r["client"] for r in json.loads(out)} == {"laptop"}
    _, out, _ = history(capsys, "--journal", str(journal), "--client", "ops")
    assert "ops" in out and "ok" in out.splitlines()[1] and len(out.splitlines()) == 2


async def test_doc_query_how_much_of_kv_cache_was_used(journal: Path) -> None:
    """Query 8 gives each model's residency that used the largest share of its kv_cache."""
    at = lambda t: datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")  # noqa: E731
    assert run_query(journal, doc_queries()[7]) == [
        ("qwen", 2, 80.0, 80.0, 100.0, at(DAY2 + 200)),
        ("llama", 1, 25.0, 10.0, 40.0, at(DAY1 + 601)),
    ]
