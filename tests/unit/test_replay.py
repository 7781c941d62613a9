"""Replaying transition rows and checking that each model's history is a legal path."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from mlxd.journal.migrate import migrate, open_database
from mlxd.journal.replay import check_history, check_journal, replay
from mlxd.residency.states import HOLDS_MEMORY, TRANSITIONS, Reason, State


def rows(*steps: tuple[str, str, str, str]) -> list[dict[str, Any]]:
    """Transition rows (model, from, to, reason) numbered from seq 1."""
    return [
        {"seq": i, "model": m, "from_state": a, "to_state": b, "reason": r}
        for i, (m, a, b, r) in enumerate(steps, start=1)
    ]


LEGAL = rows(
    ("a", "unloaded", "loading", "request"),
    ("b", "unloaded", "loading", "preload"),
    ("a", "loading", "loaded", "request"),
    ("b", "loading", "failed", "load_failed"),
    ("a", "loaded", "draining", "evicted"),
    ("b", "failed", "loading", "request"),
    ("a", "draining", "loaded", "evicted"),  # drain called off
    ("a", "loaded", "unloading", "admin"),
    ("a", "unloading", "loaded", "unload_failed"),
    ("b", "loading", "loaded", "request"),
    ("b", "loaded", "draining", "preempted"),  # then the daemon died
    ("b", "draining", "unloaded", "crash_recovery"),
    ("b", "unloaded", "loading", "restore"),
    ("c", "unloaded", "loading", "request"),
    ("c", "loading", "unloaded", "abandoned"),
)


def test_replay_gives_each_models_last_state() -> None:
    """Replaying a history gives each model the state its last row moved it to."""
    assert replay(LEGAL) == {"a": State.LOADED, "b": State.LOADING, "c": State.UNLOADED}
    assert replay([]) == {}


def test_a_legal_history_has_no_problems() -> None:
    """A history that follows the table, crash recovery included, passes the check."""
    assert check_history(LEGAL) == []


def test_illegal_moves_are_each_reported() -> None:
    """Every illegal move is listed with its seq, model and the move itself."""
    problems = check_history(
        rows(
            ("a", "unloaded", "loaded", "request"),  # skips loading
            ("a", "loaded", "unloaded", "request"),  # unloading skipped
            ("a", "unloaded", "loading", "request"),
            ("a", "loading", "unloaded", "crash_recovery"),  # legal: loading holds memory
            ("b", "unloaded", "loading", "request"),
            ("b", "loading", "failed", "load_failed"),
            ("b", "failed", "unloaded", "crash_recovery"),  # failed holds nothing: illegal
        )
    )
    assert problems == [
        "seq 1 a: unloaded -> loaded (request) is not a legal move",
        "seq 2 a: loaded -> unloaded (request) is not a legal move",
        "seq 7 b: failed -> unloaded (crash_recovery) is not a legal move",
    ]


def test_breaks_in_a_models_path_are_reported() -> None:
    """A first row not from unloaded and a row not starting where the previous ended are both caught."""
    problems = check_history(
        rows(
            ("a", "loaded", "unloading", "idle_timeout"),  # the first row of a
            ("a", "unloading", "unloaded", "idle_timeout"),
            ("b", "unloaded", "loading", "request"),
            ("b", "loaded", "unloading", "admin"),  # but b was loading
            ("b", "draining", "unloaded", "crash_recovery"),  # after b went unloading
            ("b", "loaded", "unloading", "admin"),  # after crash recovery b is unloaded
        )
    )
    assert problems == [
        "seq 1 a: the first row starts from loaded, not from unloaded",
        "seq 4 b: starts from loaded but seq 3 left it loading",
        "seq 5 b: starts from draining but seq 4 left it unloading",
        "seq 6 b: starts from loaded but seq 5 left it unloaded",
    ]


def test_rows_without_seq_and_sqlite_rows_work() -> None:
    """Rows may come as sqlite3.Row from a query or as dicts without seq."""
    conn = sqlite3.connect(":memory:")
    conn.row_factory = sqlite3.Row
    conn.execute("CREATE TABLE t(seq, model, from_state, to_state, reason)")
    conn.executemany("INSERT INTO t VALUES (:seq, :model, :from_state, :to_state, :reason)", LEGAL)
    fetched = conn.execute("SELECT * FROM t ORDER BY seq").fetchall()
    assert replay(fetched) == replay(LEGAL)
    assert check_history(fetched) == []
    bare = [{k: v for k, v in r.items() if k != "seq"} for r in LEGAL[:1]]
    bare[0]["from_state"] = "loaded"
    assert check_history(bare) == [
        "row a: the first row starts from loaded, not from unloaded",
        "row a: loaded -> loading (request) is not a legal move",
    ]


@st.composite
def walks(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict[str, State]]:
    """Random legal histories of a few models through the table (crash recovery included)."""
    state = {m: State.UNLOADED for m in ("a", "b", "c")}
    steps = []
    for _ in range(draw(st.integers(0, 40))):
        m = draw(st.sampled_from(sorted(state)))
        a = state[m]
        moves = [(b, "request") for b in sorted(TRANSITIONS[a])]
        if a in HOLDS_MEMORY:
            moves.append((State.UNLOADED, Reason.CRASH_RECOVERY.value))
        b, reason = draw(st.sampled_from(moves))
        steps.append((m, a.value, b.value, reason))
        state[m] = b
    return rows(*steps), {
        m: s for m, s in state.items() if any(r["model"] == m for r in rows(*steps))
    }


@given(walks(), st.data())
def test_random_legal_walks_pass_and_any_corruption_is_caught(
    walk: tuple[list[dict[str, Any]], dict[str, State]], data: st.DataObject
) -> None:
    """Every path through the table passes and replays to its end; changing one from_state is caught."""
    history, final = walk
    assert check_history(history) == []
    assert replay(history) == final
    if history:
        i = data.draw(st.integers(0, len(history) - 1))
        wrong = data.draw(
            st.sampled_from([s.value for s in State if s.value != history[i]["from_state"]])
        )
        corrupted = [dict(r) for r in history]
        corrupted[i]["from_state"] = wrong
        assert any(p.startswith(f"seq {i + 1} ") for p in check_history(corrupted))


def test_check_journal_finds_file_level_problems(tmp_path: Path) -> None:
    """check_journal reports a transition without its events row and a lease left open by an old run."""
    path = tmp_path / "j.db"
    conn = open_database(path)
    migrate(conn)
    conn.execute(
        "INSERT INTO runs(id, started_at, pid, version) VALUES (1, 0, 1, 'v'), (2, 9, 1, 'v')"
    )
    conn.execute(
        "INSERT INTO events VALUES (1, 1, 0, 'transition', 'a', '{}'), (3, 1, 0, 'lease_acquired', 'a', '{}')"
    )
    conn.execute(
        "INSERT INTO transitions VALUES (1, 1, 0, 'a', 'unloaded', 'loading', 'request', NULL, NULL)"
    )
    conn.execute("INSERT INTO leases(id, run_id, model, acquired_at) VALUES ('L', 1, 'a', 0)")
    assert check_journal(conn) == ["lease L: left open by run 1, which is over"]
    conn.execute("PRAGMA foreign_keys = OFF")
    conn.execute(
        "INSERT INTO transitions VALUES (2, 2, 1, 'a', 'loading', 'loaded', 'request', NULL, NULL)"
    )
    assert check_journal(conn) == [
        "foreign_key_check: transitions row 2 points at a missing events row",
        "seq 2: transition without its matching events row",
        "lease L: left open by run 1, which is over",
    ]
