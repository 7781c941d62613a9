"""Reading the journal: the queries behind ``mlxd history``, ``/admin/history`` and SSE resume.

Every function here takes a connection opened read-only
(:func:`mlxd.journal.migrate.open_readonly`), so it works while the daemon is running
(WAL lets readers run beside the writer) and while it is down. Rows come back
as plain dicts keyed by the journal's column names, oldest first: a limit keeps
the *most recent* rows, like ``tail``.

``mlxd history`` reads the file directly: ``--journal PATH``, else the
``journal.path`` of ``--config``, else the default path. ``--since`` takes an
ISO time (local when it has no offset) or a duration ago (``90s``, ``15m``,
``2h``, ``7d``); ``--limit 0`` means every row. A bad ``--since`` or ``--limit``
exits 2, a missing journal file exits 1, each with one line on stderr.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from mlxd.config import JournalConfig, Measurement
from mlxd.errors import ConfigError, JournalError
from mlxd.journal.migrate import open_readonly
from mlxd.journal.retention import pruned_through

log = logging.getLogger("mlxd.journal")

TRANSITION_COLUMNS: tuple[str, ...] = (
    "seq", "run_id", "at", "model", "from_state", "to_state", "reason", "memory_bytes", "error",
)  # fmt: skip
LEASE_COLUMNS: tuple[str, ...] = (
    "id", "run_id", "model", "request_id", "route", "acquired_at", "released_at", "outcome",
    "prompt_tokens", "completion_tokens", "client", "kv_wait_seconds",
)  # fmt: skip
EVENT_COLUMNS: tuple[str, ...] = ("seq", "run_id", "at", "kind", "model", "payload")
CHECKPOINT_COLUMNS: tuple[str, ...] = ("model", "seq", "run_id", "at", "state", "pruned")

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


# ---- queries ------------------------------------------------------------------------------


def _where(clauses: Sequence[str]) -> str:
    return (" WHERE " + " AND ".join(clauses)) if clauses else ""


def _filters(model: str | None, since: float | None, time_column: str) -> tuple[list[str], list[Any]]:
    """WHERE clauses and their parameters for the model and since filters."""
    clauses: list[str] = []
    params: list[Any] = []
    if model is not None:
        clauses.append("model = ?")
        params.append(model)
    if since is not None:
        clauses.append(f"{time_column} >= ?")
        params.append(since)
    return clauses, params


def read_transitions(
    conn: sqlite3.Connection,
    *,
    model: str | None = None,
    since: float | None = None,
    limit: int | None = 50,
) -> list[dict[str, Any]]:
    """The last ``limit`` transitions (``None``: all) matching, in journal order."""
    clauses, params = _filters(model, since, "at")
    cols = ", ".join(TRANSITION_COLUMNS)
    sql = f"SELECT {cols} FROM transitions{_where(clauses)} ORDER BY seq DESC LIMIT ?"
    rows = conn.execute(sql, [*params, -1 if limit is None else limit]).fetchall()
    return [dict(zip(TRANSITION_COLUMNS, r, strict=True)) for r in reversed(rows)]


def read_leases(
    conn: sqlite3.Connection,
    *,
    model: str | None = None,
    since: float | None = None,
    limit: int | None = 50,
    open_only: bool = False,
    client: str | None = None,
) -> list[dict[str, Any]]:
    """The last ``limit`` leases acquired (at or after ``since``; of ``client``), oldest first."""
    clauses, params = _filters(model, since, "acquired_at")
    if open_only:
        clauses.append("released_at IS NULL")
    columns = lease_columns(conn)
    if client is not None:
        if "client" not in columns:
            raise JournalError(
                "journal: this file predates leases.client (schema v1); run 'mlxd migrate'"
            )
        clauses.append("client = ?")
        params.append(client)
    cols = ", ".join(columns)
    sql = (
        f"SELECT {cols} FROM leases{_where(clauses)} ORDER BY acquired_at DESC, rowid DESC LIMIT ?"
    )
    rows = conn.execute(sql, [*params, -1 if limit is None else limit]).fetchall()
    return [dict(zip(columns, r, strict=True)) for r in reversed(rows)]


def lease_columns(conn: sqlite3.Connection) -> tuple[str, ...]:
    """The lease columns this file has: a journal not migrated yet lacks the later ones
    (``client``, schema v2; ``kv_wait_seconds``, v6)."""
    have = {r[1] for r in conn.execute("PRAGMA table_info(leases)")}
    return tuple(c for c in LEASE_COLUMNS if c in have)


def read_events_after(
    conn: sqlite3.Connection, seq: int, limit: int = 1000
) -> list[dict[str, Any]]:
    """Events with a sequence number above ``seq``, in order; ``payload`` decoded."""
    cols = ", ".join(EVENT_COLUMNS)
    rows = conn.execute(
        f"SELECT {cols} FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (seq, limit)
    ).fetchall()
    out = []
    for r in rows:
        row = dict(zip(EVENT_COLUMNS, r, strict=True))
        row["payload"] = json.loads(row["payload"])
        out.append(row)
    return out


#: model name -> its latest measurement (the memory estimate's second source)
Measurements = dict[str, Measurement]

#: each model's latest measurement with the weights it was taken on (schema v3); SQLite takes
#: the bare columns from the row that holds max(): the latest measurement
LATEST_MEASUREMENTS = (
    "SELECT m.model, m.memory_bytes, max(m.at), w.weights FROM measurements m"
    " LEFT JOIN measurement_weights w ON w.model = m.model AND w.at = m.at GROUP BY m.model"
)
#: the same on a file not migrated to v3 yet (read-only readers never migrate): weights unknown
LATEST_MEASUREMENTS_V2 = (
    "SELECT model, memory_bytes, max(at), NULL FROM measurements GROUP BY model"
)


def read_latest_measurements(conn: sqlite3.Connection) -> Measurements:
    """Each model's most recent measurement: its footprint in bytes and its weights' fingerprint."""
    has_weights = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'measurement_weights'"
    ).fetchone()
    rows = conn.execute(LATEST_MEASUREMENTS if has_weights else LATEST_MEASUREMENTS_V2).fetchall()
    return {model: Measurement(int(memory), weights) for model, memory, _, weights in rows}


@dataclass(frozen=True, slots=True)
class KvPeaks:
    """A model's KV peaks in the journal (``kv_peaks``, schema v4), one per residency kept."""

    residencies: int
    #: the highest peak of them, and the kv_cache budget of its residency
    highest_bytes: int
    highest_budget_bytes: int
    #: the latest residency's peak, its budget and when it ended
    latest_bytes: int
    latest_budget_bytes: int
    latest_at: float
    #: when the oldest residency kept ended
    since: float


#: per model: the latest row, the highest peak (SQLite takes the bare columns from the row
#: that holds the max), and how many rows since when
_KV_LATEST = "SELECT model, max(at), kv_peak_bytes, kv_budget_bytes FROM kv_peaks GROUP BY model"
_KV_HIGHEST = "SELECT model, max(kv_peak_bytes), kv_budget_bytes FROM kv_peaks GROUP BY model"
_KV_COUNT = "SELECT model, count(*), min(at) FROM kv_peaks GROUP BY model"


def read_kv_peaks(conn: sqlite3.Connection) -> dict[str, KvPeaks]:
    """Each model's journaled KV peaks ({} on a file not migrated to v4 yet)."""
    conn.execute("BEGIN")  # the three from one snapshot (WAL)
    try:
        latest = {r[0]: r[1:] for r in conn.execute(_KV_LATEST)}
        highest = {r[0]: r[1:] for r in conn.execute(_KV_HIGHEST)}
        counts = {r[0]: r[1:] for r in conn.execute(_KV_COUNT)}
    except sqlite3.OperationalError:  # no kv_peaks table: nothing measured yet
        return {}
    finally:
        conn.execute("COMMIT")
    return {
        model: KvPeaks(
            residencies=int(counts[model][0]),
            highest_bytes=int(highest[model][0]),
            highest_budget_bytes=int(highest[model][1]),
            latest_bytes=int(at_peak_budget[1]),
            latest_budget_bytes=int(at_peak_budget[2]),
            latest_at=float(at_peak_budget[0]),
            since=float(counts[model][1]),
        )
        for model, at_peak_budget in latest.items()
    }


def read_gap(conn: sqlite3.Connection, after: int) -> dict[str, Any] | None:
    """The ``gap`` event for a resume from ``after``, if pruning removed events after it.

    ``through`` is the retention watermark: events up to it may be gone, so the
    stream goes on after it; ``states`` is every model's state at ``through``
    (its checkpoint, then its kept transitions up to there), so a client that
    follows states from events stays right.
    """
    through = pruned_through(conn)
    if after >= through:
        return None
    states = read_checkpoints(conn)
    for model, state in conn.execute(
        "SELECT model, to_state FROM transitions WHERE seq <= ? ORDER BY seq", (through,)
    ):
        states[model] = state
    return {
        "kind": "gap",
        "after": after,
        "through": through,
        "states": states,
        "message": (
            f"events after {after} up to {through} were pruned by journal retention; "
            f"'states' is each model's state at {through}, and the stream goes on after it"
        ),
    }


def read_backlog(
    conn: sqlite3.Connection, after: int, limit: int = 1000
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """A resume from ``after``: the gap event if any, then the events after it, from one snapshot."""
    conn.execute("BEGIN")  # the watermark and the rows from the same snapshot (WAL)
    try:
        gap = read_gap(conn, after)
        rows = read_events_after(conn, after if gap is None else gap["through"], limit)
    finally:
        conn.execute("COMMIT")
    return gap, rows


def read_checkpoints(conn: sqlite3.Connection) -> dict[str, str]:
    """Each pruned model's checkpoint state: where its kept history starts ({} on a v1 file)."""
    try:
        return {model: state for model, state in conn.execute("SELECT model, state FROM checkpoints")}
    except sqlite3.OperationalError:  # a v1 file (not migrated yet): nothing was ever pruned
        return {}


def read_checkpoint_rows(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """The ``checkpoints`` rows, by model ([] on a v1 file)."""
    try:
        cur = conn.execute(f"SELECT {', '.join(CHECKPOINT_COLUMNS)} FROM checkpoints ORDER BY model")
    except sqlite3.OperationalError:
        return []
    return [dict(zip(CHECKPOINT_COLUMNS, r, strict=True)) for r in cur]


def read_latest_load_seconds(conn: sqlite3.Connection) -> dict[str, float]:
    """How long each model's most recent measured load took (seconds)."""
    rows = conn.execute(
        "SELECT model, load_seconds, max(at) FROM measurements GROUP BY model"
    ).fetchall()
    return {model: float(seconds) for model, seconds, _ in rows}


# ---- the CLI --------------------------------------------------------------------------------


def parse_since(text: str, *, now: float | None = None, name: str = "--since") -> float:
    """An ISO time (local if naive) or a duration ago (``90s``, ``15m``, ``2h``, ``7d``).

    ``name`` is what errors call the value: the CLI flag, or the query parameter.
    """
    now = time.time() if now is None else now
    if m := _DURATION_RE.match(text):
        return now - float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    try:
        dt = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(
            f"{name}: {text!r} is neither an ISO time (2026-11-29T10:00) "
            "nor a duration (90s, 15m, 2h, 7d)"
        ) from None
    return dt.timestamp()  # a naive datetime is taken as local time


_T = TypeVar("_T")


def _read_journal_file(
    journal: JournalConfig, read: Callable[[sqlite3.Connection], dict[str, _T]], what: str
) -> dict[str, _T]:
    """``read`` on the journal file opened read-only; {} if it is missing or unreadable."""
    path = Path(journal.path).absolute()
    if not path.is_file():
        return {}
    try:
        con = open_readonly(path)
        try:
            return read(con)
        finally:
            con.close()
    except (JournalError, sqlite3.Error) as e:  # not a journal yet, locked, or an older schema
        log.debug("could not read %s from %s: %s", what, path, e)
        return {}


def journal_measurements(journal: JournalConfig) -> Measurements:
    """The latest measurement of each model in the journal (read-only; {} if none).

    Used as ``load_config(..., measured=journal_measurements)`` so that
    ``check-config`` sees the same estimates as the daemon. Never creates or
    writes the file.
    """
    found = _read_journal_file(journal, read_latest_measurements, "measurements")
    return {model: m for model, m in found.items() if m.bytes > 0}


def journal_kv_peaks(journal: JournalConfig) -> dict[str, KvPeaks]:
    """Each model's journaled KV peaks, for ``check-config`` (read-only; {} if none)."""
    return _read_journal_file(journal, read_kv_peaks, "KV peaks")


class JournalFile:
    """Reads of a journal file, each on its own read-only connection (the daemon's
    :class:`~mlxd.journal.journal.Journal` reads its own file this way)."""

    def __init__(self, path: Path | str, *, busy_timeout_ms: int = 5000) -> None:
        self.path = Path(path).expanduser()
        self._busy_timeout_ms = busy_timeout_ms

    @contextlib.contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        conn = open_readonly(self.path, busy_timeout_ms=self._busy_timeout_ms)
        try:
            yield conn
        except sqlite3.Error as e:
            raise JournalError(f"journal: cannot read {self.path}: {e}") from e
        finally:
            conn.close()

    def history(
        self, model: str | None = None, since: float | None = None, limit: int | None = 50
    ) -> list[dict[str, Any]]:
        """The last ``limit`` transitions (of ``model``, at or after ``since``), oldest first."""
        with self._reader() as conn:
            return read_transitions(conn, model=model, since=since, limit=limit)

    def leases(
        self,
        model: str | None = None,
        since: float | None = None,
        limit: int | None = 50,
        *,
        open_only: bool = False,
    ) -> list[dict[str, Any]]:
        """The last ``limit`` leases (of ``model``, acquired at or after ``since``), oldest first."""
        with self._reader() as conn:
            return read_leases(conn, model=model, since=since, limit=limit, open_only=open_only)

    def events_after(self, seq: int, limit: int = 1000) -> list[dict[str, Any]]:
        """Committed events with a seq above ``seq`` (SSE resume from ``Last-Event-ID``)."""
        with self._reader() as conn:
            return read_events_after(conn, seq, limit)

    def backlog(
        self, seq: int, limit: int = 1000
    ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """SSE resume from ``seq``: a ``gap`` event if retention pruned events after it, then events."""
        with self._reader() as conn:
            return read_backlog(conn, seq, limit)

    def checkpoints(self) -> list[dict[str, Any]]:
        """The ``checkpoints`` rows: where each pruned model's kept history starts."""
        with self._reader() as conn:
            return read_checkpoint_rows(conn)

    def latest_measurements(self) -> Measurements:
        """Each model's latest measurement (the memory estimate's second source)."""
        with self._reader() as conn:
            return read_latest_measurements(conn)

    def latest_load_seconds(self) -> dict[str, float]:
        """How long each model's latest measured load took (cost eviction, ETAs, progress)."""
        with self._reader() as conn:
            return read_latest_load_seconds(conn)
