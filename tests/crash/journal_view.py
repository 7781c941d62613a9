"""The journal file as the crash supervisor sees it: a read-only snapshot, and acknowledged states."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxd.journal.migrate import open_readonly
from mlxd.journal.replay import check_history, check_journal

#: states whose model recovery must reload (``restore_on_start``)
RESIDENT = ("loaded", "draining")


@dataclass
class Snapshot:
    """What the file says (read-only) at one moment."""

    exists: bool
    version: int = 0
    tables: tuple[str, ...] = ()
    integrity: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    illegal: int = 0
    #: (seq, run_id, at, model, from, to, reason), in seq order
    transitions: list[tuple[Any, ...]] = field(default_factory=list)
    #: id -> (run_id, released_at, outcome)
    leases: dict[str, tuple[int, float | None, str | None]] = field(default_factory=dict)
    max_run: int = 0
    #: the column the test migration adds to ``runs`` is there
    probe_column: bool = False
    #: model -> (at, state) of its checkpoint (where retention's pruning left it)
    checkpoints: dict[str, tuple[float, str]] = field(default_factory=dict)
    #: model -> the run of its checkpoint's row (the run whose rows retention reached last)
    checkpoint_runs: dict[str, int] = field(default_factory=dict)
    #: events rows retention has pruned from the file so far
    events_pruned: int = 0
    #: released leases rows retention has pruned so far (an open lease is never pruned)
    leases_pruned: int = 0

    def last_states(self) -> dict[str, tuple[int, str]]:
        """Each model's (seq, state) after its last row."""
        return {r[3]: (r[0], r[5]) for r in self.transitions}

    def resident(self) -> list[str]:
        """Models whose last state is loaded or draining, oldest last row first (as recovery orders them)."""
        last = sorted(self.last_states().items(), key=lambda kv: kv[1][0])
        return [m for m, (_, state) in last if state in RESIDENT]

    def rows_of_run(self, run_id: int) -> list[tuple[Any, ...]]:
        return [r for r in self.transitions if r[1] == run_id]


def snapshot(path: Path) -> Snapshot:
    if not path.exists():
        return Snapshot(exists=False)
    conn = open_readonly(path)
    try:
        snap = Snapshot(exists=True)
        snap.version = conn.execute("PRAGMA user_version").fetchone()[0]
        snap.tables = tuple(
            r[0] for r in conn.execute("SELECT name FROM sqlite_master ORDER BY name")
        )
        snap.integrity = [r[0] for r in conn.execute("PRAGMA integrity_check")]
        if snap.version == 0:
            return snap
        snap.probe_column = any(
            r[1] == "crash_probe_note" for r in conn.execute("PRAGMA table_info(runs)")
        )
        conn.execute("BEGIN")  # one snapshot: a live daemon may prune between two reads
        snap.problems = check_journal(conn)
        if "checkpoints" in snap.tables:
            rows = conn.execute("SELECT model, at, state, run_id FROM checkpoints").fetchall()
            snap.checkpoints = {r[0]: (r[1], r[2]) for r in rows}
            snap.checkpoint_runs = {r[0]: r[3] for r in rows}
            snap.events_pruned, snap.leases_pruned = conn.execute(
                "SELECT events_pruned, leases_pruned FROM retention"
            ).fetchone()
        snap.transitions = [
            tuple(r)
            for r in conn.execute(
                "SELECT seq, run_id, at, model, from_state, to_state, reason FROM transitions"
                " ORDER BY seq"
            )
        ]
        columns = ("seq", "model", "from_state", "to_state", "reason")
        snap.illegal = len(
            check_history(
                (dict(zip(columns, r[:1] + r[3:], strict=True)) for r in snap.transitions),
                {m: state for m, (_, state) in snap.checkpoints.items()},
            )
        )
        snap.leases = {
            r[0]: (r[1], r[2], r[3])
            for r in conn.execute("SELECT id, run_id, released_at, outcome FROM leases")
        }
        snap.max_run = conn.execute("SELECT coalesce(max(id), 0) FROM runs").fetchone()[0]
        conn.execute("COMMIT")
        return snap
    finally:
        conn.close()


@dataclass(frozen=True)
class Ack:
    """An admin reply 200: ``model`` was ``state`` at some moment in [sent, received]."""

    model: str
    state: str
    sent: float
    received: float


def ack_was_pruned(snap: Snapshot, ack: Ack) -> bool:
    """Retention pruned rows from the ack's window (the model's checkpoint is after its send)."""
    checkpoint = snap.checkpoints.get(ack.model)
    return checkpoint is not None and checkpoint[0] >= ack.sent


def ack_is_journaled(snap: Snapshot, ack: Ack) -> bool:
    """The journaled state of the model is the acknowledged one at the send time or in a row before the reply.

    A model whose older rows were pruned starts from its checkpoint's state.
    """
    state = snap.checkpoints.get(ack.model, (0.0, "unloaded"))[1]
    for _seq, _run, at, model, _from, to, _reason in snap.transitions:
        if model != ack.model:
            continue
        if at <= ack.sent:
            state = to
        elif at <= ack.received and to == ack.state:
            return True
    return state == ack.state
