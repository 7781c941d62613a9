"""Journal retention: pruning the oldest rows in small slices, checkpoints, incremental vacuum.

Theory of operation
-------------------
``journal.retain_days`` and ``journal.max_mb`` (:class:`Policy`) bound the
journal. The writer process (:mod:`mlxd.journal.writer`) owns a
:class:`Pruner` and, while it says there is work (:meth:`Pruner.due`), runs
one *slice* at a time on its connection: inside the transaction of a batch of
live records (no extra fsync; at most :data:`ALONG_FACTOR` events pruned per
record written, so the commit is later by about what the batch's own inserts
took, while pruning still outpaces the records), or in a transaction of its
own when no record is waiting (about :data:`SLICE_S`, the longest a record
arriving meanwhile can wait for it; the events per slice adapt to the
measured time).

A slice prunes the events with the next ``batch`` sequence numbers after the
watermark ``retention.pruned_through`` (P), up to C, in journal order:

* the ``leases`` rows whose ``lease_released`` event is in (P, C]: released
  leases only, so **an open lease is never pruned**;
* the transitions in (P, C] that have a later transition of the same model, so
  **a model's latest transition is never pruned**; before they go, each
  model's ``checkpoints`` row moves to its last pruned transition (``state`` is
  that row's ``to_state``: where the kept history starts);
* the events rows in (P, C], except those of the transitions kept;
* every 32nd slice, ``measurements`` and ``kv_peaks`` older than C's time,
  except each model's latest (the memory estimate reads the measurement,
  ``check-config`` the peak);
* then ``pruned_through = C`` and the totals.

``runs`` rows are never pruned (one per start). By age, C stops before the
first event newer than ``retain_days``; by size, slices go on while the pages
in use exceed :data:`TARGET_SHARE` of ``max_mb``. A file with more free pages
than the slack (:data:`SLACK_SHARE` of ``max_mb``, or :data:`AGE_SLACK` without it)
gives the rest back with ``PRAGMA incremental_vacuum`` in the same slices, so
the file stays under ``max_mb`` and shrinks while the daemon runs. When nothing
prunable is left (only latest transitions, open leases and runs), the pruner
rests for :data:`STUCK_REST_S` and says so once (:attr:`Pruner.note`).

A slice is part of a transaction: killed midway, none of it happened. So the
watermark, the checkpoints and the rows always agree, and replaying a model
from its checkpoint gives the state replaying its whole history gave
(:func:`mlxd.journal.replay.replay`).

Incremental vacuum
------------------
A journal created by schema v2 code has ``auto_vacuum = INCREMENTAL`` from its
first page (:func:`mlxd.journal.migrate.open_database` sets it before the first
table). A file made before has ``NONE``, and SQLite applies a new mode to an
existing file only with a ``VACUUM``, which rewrites the whole file and cannot
run inside a transaction, so no migration can do it. It is done once, outside
any migration: by ``mlxd migrate`` (with the daemon stopped: it takes the
journal's lock), or by the writer process at the daemon's start when the file
is at most :data:`CONVERT_AT_START_BYTES` (a VACUUM of that takes about a
second); a bigger file is left as it is, with a warning saying to run ``mlxd
migrate``. A VACUUM is atomic: killed midway, the file is as it was. Until the
conversion, pruning frees pages inside the file (new rows reuse them), but the
file does not shrink.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mlxd.faults import crash_point
from mlxd.units import MIB, format_bytes

#: an older journal up to this size is converted to incremental vacuum when the daemon starts
CONVERT_AT_START_BYTES = 64 * MIB

#: the WAL file is given this share of max_mb (at most WAL_MAX, SQLite's default checkpoint size)
WAL_SHARE, WAL_MAX = 0.10, 4 * MIB
#: size pruning brings the pages in use down to this share of what max_mb leaves the file
TARGET_SHARE = 0.85
#: free pages up to this share of max_mb are kept for new rows; more go back to the system
SLACK_SHARE = 0.05
#: ... or, without max_mb, up to this many bytes
AGE_SLACK = 1 * MIB
#: the longest slice in a transaction of its own (a record arriving meanwhile waits for it)
SLICE_S = 0.010
#: a slice inside a batch of live records prunes at most this many events per record written...
ALONG_FACTOR = 2
#: ... and gives back at most this many free pages
ALONG_VACUUM_PAGES = 16
#: events per slice: first guess and bounds (it adapts to the measured time)
FIRST_BATCH, MIN_BATCH, MAX_BATCH = 256, 16, 8192
#: seconds between two checks of the age limit when nothing was due
AGE_CHECK_S = 1.0
#: seconds the pruner rests when nothing prunable is left
STUCK_REST_S = 10.0
#: measurements and KV peaks are pruned on every this many slices
MEASUREMENTS_EVERY = 32

_MODES = {0: "none", 1: "full", 2: "incremental"}


@dataclass(frozen=True, slots=True)
class Policy:
    """What to keep: ``retain_days`` (0: any age) and ``max_bytes`` (0: any size)."""

    retain_days: float = 0.0
    max_bytes: int = 0

    @property
    def enabled(self) -> bool:
        return self.retain_days > 0 or self.max_bytes > 0

    @property
    def wal_bytes(self) -> int:
        """The WAL beside the file: checkpointed, and cut back to this, past this size."""
        return min(WAL_MAX, int(self.max_bytes * WAL_SHARE)) if self.max_bytes > 0 else WAL_MAX

    @property
    def target_bytes(self) -> int:
        """Pages in use are pruned down to this (the file plus its slack plus the WAL fit max_mb)."""
        return int((self.max_bytes - self.wal_bytes) * TARGET_SHARE)

    @property
    def slack_bytes(self) -> int:
        return int(self.max_bytes * SLACK_SHARE) if self.max_bytes > 0 else AGE_SLACK


@dataclass(frozen=True, slots=True)
class Pruned:
    """What one slice did."""

    through: int
    events: int
    transitions: int
    leases: int
    measurements: int
    kv_peaks: int
    vacuumed_pages: int


# ---- reading the file's state -----------------------------------------------------------------


def auto_vacuum_mode(conn: sqlite3.Connection) -> str:
    """``none``, ``full`` or ``incremental``: the file's auto-vacuum mode."""
    return _MODES.get(int(conn.execute("PRAGMA auto_vacuum").fetchone()[0]), "none")


def _pragma(conn: sqlite3.Connection, name: str) -> int:
    return int(conn.execute(f"PRAGMA {name}").fetchone()[0])


def file_bytes(conn: sqlite3.Connection) -> int:
    """The size of the main database file in bytes (pages times page size)."""
    return _pragma(conn, "page_count") * _pragma(conn, "page_size")


def used_bytes(conn: sqlite3.Connection) -> int:
    """Bytes of the pages in use (the file less its free pages)."""
    pages = _pragma(conn, "page_count") - _pragma(conn, "freelist_count")
    return pages * _pragma(conn, "page_size")


def pruned_through(conn: sqlite3.Connection) -> int:
    """Every events row with a seq up to this may be pruned (0: nothing was; v1 files too)."""
    try:
        row = conn.execute("SELECT pruned_through FROM retention WHERE id = 1").fetchone()
    except sqlite3.OperationalError:  # a v1 file: no retention table
        return 0
    return int(row[0]) if row is not None else 0


# ---- one slice ---------------------------------------------------------------------------------

_RELEASED_IN_RANGE = (
    "SELECT json_extract(payload, '$.lease_id') FROM events"
    " WHERE seq > :p AND seq <= :c AND kind = 'lease_released'"
)
_HAS_LATER = (
    "EXISTS (SELECT 1 FROM transitions later"
    " WHERE later.model = {t}.model AND later.seq > {t}.seq)"
)
PRUNE_LEASES = (
    f"DELETE FROM leases WHERE released_at IS NOT NULL AND id IN ({_RELEASED_IN_RANGE})"
)
MOVE_CHECKPOINTS = (
    "INSERT INTO checkpoints(model, seq, run_id, at, state, pruned)"
    " SELECT model, max(seq), run_id, at, to_state, count(*) FROM transitions t"
    " WHERE seq > :p AND seq <= :c AND " + _HAS_LATER.format(t="t") + " GROUP BY model"
    " ON CONFLICT(model) DO UPDATE SET seq = excluded.seq, run_id = excluded.run_id,"
    " at = excluded.at, state = excluded.state, pruned = checkpoints.pruned + excluded.pruned"
)
PRUNE_TRANSITIONS = (
    "DELETE FROM transitions WHERE seq > :p AND seq <= :c AND "
    + _HAS_LATER.format(t="transitions")
)
PRUNE_EVENTS = (
    "DELETE FROM events WHERE seq > :p AND seq <= :c"
    " AND seq NOT IN (SELECT seq FROM transitions WHERE seq > :p AND seq <= :c)"
)
_OLDER_NOT_LATEST = (
    "DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} m WHERE at < :at"
    " AND EXISTS (SELECT 1 FROM {t} n WHERE n.model = m.model AND n.at > m.at))"
)
PRUNE_MEASUREMENTS = _OLDER_NOT_LATEST.format(t="measurements")
PRUNE_KV_PEAKS = _OLDER_NOT_LATEST.format(t="kv_peaks")
ADVANCE = (
    "UPDATE retention SET pruned_through = :c, pruned_at = :now,"
    " events_pruned = events_pruned + :events, transitions_pruned = transitions_pruned + :transitions,"
    " leases_pruned = leases_pruned + :leases, measurements_pruned = measurements_pruned + :measurements,"
    " kv_peaks_pruned = kv_peaks_pruned + :kv_peaks WHERE id = 1"
)


def prune_range(
    conn: sqlite3.Connection, p: int, c: int, c_at: float, now: float, *, measurements: bool
) -> Pruned:
    """Prune the events in (p, c] and what goes with them (see the module doc); in the caller's transaction."""
    args = {"p": p, "c": c}
    leases = conn.execute(PRUNE_LEASES, args).rowcount
    crash_point("journal.mid_prune")
    conn.execute(MOVE_CHECKPOINTS, args)
    transitions = conn.execute(PRUNE_TRANSITIONS, args).rowcount
    events = conn.execute(PRUNE_EVENTS, args).rowcount
    gone = conn.execute(PRUNE_MEASUREMENTS, {"at": c_at}).rowcount if measurements else 0
    peaks = conn.execute(PRUNE_KV_PEAKS, {"at": c_at}).rowcount if measurements else 0
    counts = {"events": events, "transitions": transitions, "leases": leases,
              "measurements": gone, "kv_peaks": peaks}  # fmt: skip
    conn.execute(ADVANCE, {**args, "now": now, **counts})
    return Pruned(c, events, transitions, leases, gone, peaks, 0)


class Pruner:
    """The writer process's pruning state: what is due, and slices that adapt to the time they take."""

    def __init__(
        self,
        policy: Policy,
        *,
        clock: Callable[[], float] = time.time,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._timer = timer
        self.batch = FIRST_BATCH
        self.vacuum_pages = 64
        self._slices = 0
        #: no need to look again before this (timer seconds)
        self._quiet_until = 0.0
        self._incremental: bool | None = None
        #: pruned since the last idle checkpoint
        self._dirty = False
        #: a line for the log, once, when pruning cannot get the file under max_mb
        self.note: str | None = None
        self._noted = False

    def setup(self, conn: sqlite3.Connection) -> None:
        """The writer's connection: checkpoint the WAL, and cut it back, at :attr:`Policy.wal_bytes`."""
        wal = self.policy.wal_bytes
        conn.execute(f"PRAGMA wal_autocheckpoint = {max(16, wal // _pragma(conn, 'page_size'))}")
        conn.execute(f"PRAGMA journal_size_limit = {wal}")

    def idle(self, conn: sqlite3.Connection) -> None:
        """When the writer goes idle after pruning: a checkpoint that lets the file and WAL shrink.

        ``TRUNCATE`` with no busy wait: if a reader holds an old snapshot, it does
        what it can now (like ``PASSIVE``) and the next checkpoint does the rest.
        """
        if not self._dirty:
            return
        self._dirty = False
        busy = _pragma(conn, "busy_timeout")
        conn.execute("PRAGMA busy_timeout = 0")
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error:
            pass  # the next checkpoint tries again
        finally:
            conn.execute(f"PRAGMA busy_timeout = {busy}")

    def due(self, conn: sqlite3.Connection) -> bool:
        """Cheap: is there pruning or vacuuming to do now?"""
        if not self.policy.enabled or self._timer() < self._quiet_until:
            return False
        if self._over_size(conn) or self._vacuum_due(conn):
            return True
        cutoff = self._cutoff()
        if cutoff is not None:
            first = conn.execute(
                "SELECT at FROM events WHERE seq > ? ORDER BY seq LIMIT 1", (pruned_through(conn),)
            ).fetchone()
            if first is not None and first[0] < cutoff:
                return True
        self._quiet_until = self._timer() + AGE_CHECK_S
        return False

    def along(self, conn: sqlite3.Connection, records: int) -> list[tuple[int, str]]:
        """A slice inside the transaction of a batch of ``records`` live records.

        It prunes at most :data:`ALONG_FACTOR` events per record of the batch (and
        gives back at most :data:`ALONG_VACUUM_PAGES` pages), so the batch's commit
        is later by about the time its own inserts took, never by a whole slice,
        while pruning still outpaces the records. Its failure is undone (a
        savepoint) and never fails the batch. Returns lines for the log.
        """
        conn.execute("SAVEPOINT prune")
        try:
            self.slice(conn, SLICE_S, limit=max(MIN_BATCH, ALONG_FACTOR * records))
        except sqlite3.Error as e:
            conn.execute("ROLLBACK TO prune")
            self._failed(e)
        conn.execute("RELEASE prune")
        return self._notes()

    def alone(self, conn: sqlite3.Connection) -> list[tuple[int, str]]:
        """A slice of :data:`SLICE_S` in a transaction of its own. Returns lines for the log."""
        try:
            conn.execute("BEGIN IMMEDIATE")
            self.slice(conn, SLICE_S)
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            self._failed(e)
        return self._notes()

    def _failed(self, error: sqlite3.Error) -> None:
        self.rest()
        self.note = f"journal: pruning failed ({type(error).__name__}: {error}); retrying later"

    def _notes(self) -> list[tuple[int, str]]:
        if self.note is None:
            return []
        note, self.note = self.note, None
        return [(logging.WARNING, note)]

    def rest(self) -> None:
        """Look again only after :data:`STUCK_REST_S` (after a failure)."""
        self._quiet_until = self._timer() + STUCK_REST_S

    def slice(
        self, conn: sqlite3.Connection, budget_s: float, *, limit: int | None = None
    ) -> Pruned | None:
        """One slice inside the caller's transaction; None if nothing was due.

        About ``budget_s`` long (the events per slice adapt to the time taken);
        ``limit`` caps the events pruned and the pages vacuumed further.
        """
        t0 = self._timer()
        pruned = self._prune(conn, self.batch if limit is None else min(self.batch, limit))
        took = self._timer() - t0
        if pruned is not None:
            self._adapt(took, budget_s)
        vacuumed = 0
        if took < budget_s and self._vacuum_due(conn):
            pages = None if limit is None else ALONG_VACUUM_PAGES
            vacuumed = self._vacuum(conn, t0 + budget_s, pages)
        if pruned is None and not vacuumed:
            return None
        self._dirty = True
        if pruned is None:
            return Pruned(pruned_through(conn), 0, 0, 0, 0, 0, vacuumed)
        return replace(pruned, vacuumed_pages=vacuumed)

    # -- internals --

    def _cutoff(self) -> float | None:
        days = self.policy.retain_days
        return self._clock() - days * 86400.0 if days > 0 else None

    def _over_size(self, conn: sqlite3.Connection) -> bool:
        return self.policy.max_bytes > 0 and used_bytes(conn) > self.policy.target_bytes

    def _vacuum_due(self, conn: sqlite3.Connection) -> bool:
        if self._incremental is None:
            self._incremental = auto_vacuum_mode(conn) == "incremental"
        if not self._incremental:
            return False
        free = _pragma(conn, "freelist_count") * _pragma(conn, "page_size")
        return free > self.policy.slack_bytes

    def _prune(self, conn: sqlite3.Connection, batch: int) -> Pruned | None:
        p = pruned_through(conn)
        rows = conn.execute(
            "SELECT seq, at FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (p, batch)
        ).fetchall()
        if self._over_size(conn):
            chosen = rows[: self._needed(conn, p)]
        else:
            cutoff = self._cutoff()
            chosen = [] if cutoff is None else [r for r in rows if r[1] < cutoff]
        if not chosen:
            if rows == [] and self._over_size(conn):
                self._stuck(conn)
            return None
        self._slices += 1
        c, c_at = chosen[-1]
        measurements = self._slices % MEASUREMENTS_EVERY == 0
        return prune_range(conn, p, c, c_at, self._clock(), measurements=measurements)

    def _needed(self, conn: sqlite3.Connection, p: int) -> int:
        """About how many events to prune to get under the size target (never fewer than MIN_BATCH).

        The excess over the target, over the average bytes per sequence number
        still kept: a slice then prunes what is needed, not a whole batch, so
        the journal keeps as much history as fits.
        """
        last = conn.execute("SELECT max(seq) FROM events").fetchone()[0] or p
        used = used_bytes(conn)
        per_seq = used / max(1, last - p)
        return max(MIN_BATCH, int((used - self.policy.target_bytes) / per_seq) + 1)

    def _stuck(self, conn: sqlite3.Connection) -> None:
        self.rest()
        if not self._noted:
            self._noted = True
            self.note = (
                f"journal: only rows that are never pruned (each model's latest transition, open "
                f"leases, runs) are left, and they use {format_bytes(used_bytes(conn))}, over "
                f"{TARGET_SHARE:.0%} of journal.max_mb ({format_bytes(self.policy.max_bytes)})"
            )

    def _adapt(self, took: float, budget_s: float) -> None:
        if took > budget_s:
            self.batch = max(MIN_BATCH, self.batch // 2)
        elif took < budget_s / 2:
            self.batch = min(MAX_BATCH, self.batch + self.batch // 2)

    def _vacuum(self, conn: sqlite3.Connection, deadline: float, pages: int | None) -> int:
        """Give free pages beyond the slack back (at most ``pages``), one per statement, until ``deadline``."""
        page = _pragma(conn, "page_size")
        excess = _pragma(conn, "freelist_count") - self.policy.slack_bytes // page
        if pages is not None:
            excess = min(excess, pages)
        done = 0
        while done < excess:
            for _ in range(min(16, excess - done)):
                conn.execute("PRAGMA incremental_vacuum")  # Python's sqlite3 steps it once: one page
                done += 1
            if self._timer() >= deadline:
                break
        return done


# ---- converting an older file -------------------------------------------------------------------


def convert_to_incremental(conn: sqlite3.Connection) -> tuple[int, int] | None:
    """Switch the file to incremental auto-vacuum with one VACUUM; None if it already is.

    Returns the file's size before and after. ``conn`` must be outside a
    transaction (autocommit mode).
    """
    if auto_vacuum_mode(conn) == "incremental":
        return None
    before = file_bytes(conn)
    conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    conn.execute("VACUUM")
    return before, file_bytes(conn)


def convert_at_start(conn: sqlite3.Connection, path: Path) -> tuple[int, str] | None:
    """At the daemon's start: convert a small older file; returns ``(logging level, line)``, if any."""
    if auto_vacuum_mode(conn) == "incremental":
        return None
    size = file_bytes(conn)
    if size > CONVERT_AT_START_BYTES:
        return logging.WARNING, (
            f"journal: {path} ({format_bytes(size)}) predates incremental vacuum, so pruned "
            "space is reused but the file does not shrink; stop mlxd and run "
            "'mlxd migrate' once to convert it"
        )
    sizes = convert_to_incremental(conn)
    assert sizes is not None
    return logging.INFO, (
        f"journal: {path} converted to incremental vacuum "
        f"({format_bytes(sizes[0])} -> {format_bytes(sizes[1])})"
    )
