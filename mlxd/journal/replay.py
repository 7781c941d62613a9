"""Rebuilding residency state from journal rows, and checking that history is legal.

Pure functions over ``transitions`` rows (dicts or ``sqlite3.Row`` with the
journal's column names), given in journal order (ascending ``seq``), as
:func:`mlxd.journal.reads.read_transitions` returns them. No I/O, except
:func:`check_journal`, which runs the same checks and the file-level ones on a
connection (for the crash tests and for an operator's sanity check).

Promise 7 of DESIGN.md ("each model's journal is a path through the table;
replaying the journal gives the manager's current state") is checked with
these two functions:

* :func:`replay` applies every row's ``to_state``; a model with no row is not
  in the result (it is ``unloaded``). After pruning (:mod:`mlxd.journal.retention`)
  a model's kept rows start from its ``checkpoints`` row, which both functions
  take as the model's starting state.
* :func:`check_history` lists every break in a model's path: a first row that
  does not start from ``unloaded``, a row that does not start where the
  previous one ended, and a move that :func:`mlxd.residency.states.is_legal` refuses
  (the ``crash_recovery`` edge ``<holding memory> -> unloaded`` included,
  after which the model is ``unloaded`` like after any row to that state).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from mlxd.journal.reads import read_checkpoints
from mlxd.residency.states import State, is_legal


class TransitionRow(Protocol):
    def __getitem__(self, key: str, /) -> Any: ...


#: model -> the state its kept history starts from (``checkpoints.state``, after pruning)
Checkpoints = Mapping[str, str]


def replay(
    rows: Iterable[TransitionRow | Mapping[str, Any]], checkpoints: Checkpoints | None = None
) -> dict[str, State]:
    """Each model's state after applying ``rows`` in order, from its checkpoint if it has one.

    A model with a checkpoint but no row left cannot happen (pruning keeps each
    model's latest transition); it replays to its checkpoint's state.
    """
    states: dict[str, State] = {m: State(s) for m, s in (checkpoints or {}).items()}
    for row in rows:
        states[row["model"]] = State(row["to_state"])
    return states


def _where(row: TransitionRow | Mapping[str, Any]) -> str:
    try:
        seq = row["seq"]
    except (KeyError, IndexError):
        seq = None
    return f"seq {seq}" if seq is not None else "row"


def check_history(
    rows: Iterable[TransitionRow | Mapping[str, Any]], checkpoints: Checkpoints | None = None
) -> list[str]:
    """Every illegal step of every model's path, as one readable line each (empty: legal).

    A model with a checkpoint (its older rows were pruned) starts from the
    checkpoint's state instead of ``unloaded``.
    """
    problems: list[str] = []
    # model -> (state it is in, where that came from)
    current: dict[str, tuple[str, str]] = {
        m: (state, "its checkpoint") for m, state in (checkpoints or {}).items()
    }
    for row in rows:
        model, src, dst, reason = row["model"], row["from_state"], row["to_state"], row["reason"]
        here = _where(row)
        previous = current.get(model)
        if previous is None:
            if src != State.UNLOADED:
                problems.append(
                    f"{here} {model}: the first row starts from {src}, not from unloaded"
                )
        elif src != previous[0]:
            problems.append(
                f"{here} {model}: starts from {src} but {previous[1]} left it {previous[0]}"
            )
        if not is_legal(src, dst, reason):
            problems.append(f"{here} {model}: {src} -> {dst} ({reason}) is not a legal move")
        current[model] = (dst, here)
    return problems


def check_journal(conn: sqlite3.Connection) -> list[str]:
    """Everything wrong with a journal file (empty: sound).

    ``PRAGMA integrity_check`` and ``foreign_key_check``; each transition has an
    ``events`` row of kind ``transition`` with the same seq; the whole history
    passes :func:`check_history` (from the checkpoints of pruned models); no
    lease is left open by a run that has stopped or by any run but the newest.
    """
    problems: list[str] = []
    integrity = [r[0] for r in conn.execute("PRAGMA integrity_check").fetchall()]
    if integrity != ["ok"]:
        problems.extend(f"integrity_check: {line}" for line in integrity)
    for table, rowid, parent, _ in conn.execute("PRAGMA foreign_key_check").fetchall():
        problems.append(f"foreign_key_check: {table} row {rowid} points at a missing {parent} row")
    for (seq,) in conn.execute(
        "SELECT t.seq FROM transitions t LEFT JOIN events e ON e.seq = t.seq"
        " WHERE e.seq IS NULL OR e.kind != 'transition' OR e.model != t.model ORDER BY t.seq"
    ):
        problems.append(f"seq {seq}: transition without its matching events row")
    columns = ("seq", "model", "from_state", "to_state", "reason")
    rows = [
        dict(zip(columns, r, strict=True))
        for r in conn.execute(
            "SELECT seq, model, from_state, to_state, reason FROM transitions ORDER BY seq"
        )
    ]
    problems.extend(check_history(rows, read_checkpoints(conn)))
    for lease_id, run_id in conn.execute(
        "SELECT l.id, l.run_id FROM leases l JOIN runs r ON r.id = l.run_id"
        " WHERE l.released_at IS NULL"
        " AND (r.stopped_at IS NOT NULL OR r.id < (SELECT max(id) FROM runs))"
        " ORDER BY l.acquired_at"
    ):
        problems.append(f"lease {lease_id}: left open by run {run_id}, which is over")
    return problems
