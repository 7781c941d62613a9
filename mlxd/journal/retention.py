"""Journal retention: pruning the oldest rows in small slices, checkpoints, incremental vacuum.

Theory of operation
-------------------
``journal.retain_days`` and ``journal.max_mb`` (:class:`Policy`) bound the
journal. The writer process (:mod:`mlxd.journal.writer`) owns a
:class:`Pruner` and, while it says there is work (:meth:`Pruner.due`), runs
one *slice* at a time on its connection, always in a transaction of its own,
never in the transaction of live records (their commits stay as small as
without pruning), and committed without an fsync of its own (``synchronous =
NORMAL`` for that commit only: a slice lost to a power cut is simply done
again, and the next live commit's fsync makes it durable). A slice lasts about
:data:`SLICE_S` (the events per slice adapt to the measured time), the longest
a live record arriving meanwhile waits for it. When slices may run
(:meth:`Pruner.may_run`):

* when no live record waits: the writer prunes in the gaps between its commits;
* with records waiting, only when pruning is *behind* (by size, the pages in
  use :data:`BEHIND_SHARE` of ``max_mb`` over the target; or due for
  :data:`BEHIND_S` with no slice in an idle moment), and then for at most
  :data:`BUSY_SHARE` of the writer's time: a writer that is never idle still
  prunes, and live records still get three quarters of its time.

The writer checkpoints the WAL with ``TRUNCATE`` (:meth:`Pruner.idle`) only
after :data:`QUIET_S` without a message, never between the commits of a busy
writer (a checkpoint's fsync of the database file would hold the next commit).

A slice prunes the events with the next ``batch`` sequence numbers after the
watermark ``retention.pruned_through`` (P), up to C, in journal order:

* the ``leases`` rows whose ``lease_released`` event is in (P, C]: released
  leases only, so **an open lease is never pruned**;
* the transitions up to C that have a later transition of the same model, so
  **a model's latest transition is never pruned**: those in (P, C], and one
  kept below P as its model's latest that a newer one has since superseded
  (else it would stay, older than its model's checkpoint, and a replay in seq
  order would read it after the checkpoint); before they go, each
  model's ``checkpoints`` row moves to its last pruned transition (``state`` is
  that row's ``to_state``: where the kept history starts);
* the events rows in (P, C], except those of the transitions kept, and those
  of the superseded transitions below P;
* every 32nd slice, ``measurements`` and ``kv_peaks`` older than C's time,
  except each model's latest (the memory estimate reads the measurement,
  ``check-config`` the peak);
* the stored ``responses`` created before C's time (schema v5: a response
  goes with the events of its time, :mod:`mlxd.journal.responses`);
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

from mlxd.crash_points import crash_point
from mlxd.journal.responses import PRUNE_RESPONSES
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
#: the longest slice (a live record arriving meanwhile waits for it and its fsync-less commit)
SLICE_S = 0.003
#: with live records waiting, a slice runs only when pruning is behind, and pruning then takes
#: at most this share of the writer's time
BUSY_SHARE = 0.25
#: behind: by size, the pages in use this share of max_mb over the target...
BEHIND_SHARE = 0.04
#: ... or due for this many seconds with no slice in an idle moment (a writer never idle)
BEHIND_S = 0.5
#: by size, slices prune down to this share of max_mb under the target (fewer, fuller slices)
HYSTERESIS_SHARE = 0.01
#: seconds without a message after which an idle writer that pruned checkpoints the WAL
QUIET_S = 0.5
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
    responses: int = 0


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
#: ``NOT INDEXED``: the rows up to C by rowid (below P only kept ones are left), not the whole
#: table in (model, seq) order, which SQLite picks for the GROUP BY without a lower bound
MOVE_CHECKPOINTS = (
    "INSERT INTO checkpoints(model, seq, run_id, at, state, pruned)"
    " SELECT model, max(seq), run_id, at, to_state, count(*) FROM transitions t NOT INDEXED"
    " WHERE seq <= :c AND " + _HAS_LATER.format(t="t") + " GROUP BY model"
    " ON CONFLICT(model) DO UPDATE SET seq = excluded.seq, run_id = excluded.run_id,"
    " at = excluded.at, state = excluded.state, pruned = checkpoints.pruned + excluded.pruned"
)
PRUNE_TRANSITIONS = (
    "DELETE FROM transitions WHERE seq <= :c AND " + _HAS_LATER.format(t="transitions")
)
PRUNE_EVENTS = (
    "DELETE FROM events WHERE seq > :p AND seq <= :c"
    " AND seq NOT IN (SELECT seq FROM transitions WHERE seq > :p AND seq <= :c)"
)
#: below P only kept transitions' events are left: those whose transition went
PRUNE_SUPERSEDED_EVENTS = (
    "DELETE FROM events WHERE seq <= :p AND kind = 'transition'"
    " AND seq NOT IN (SELECT seq FROM transitions WHERE seq <= :p)"
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
    " kv_peaks_pruned = kv_peaks_pruned + :kv_peaks, responses_pruned = responses_pruned + :responses"
    " WHERE id = 1"
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
    events += conn.execute(PRUNE_SUPERSEDED_EVENTS, args).rowcount
    gone = conn.execute(PRUNE_MEASUREMENTS, {"at": c_at}).rowcount if measurements else 0
    peaks = conn.execute(PRUNE_KV_PEAKS, {"at": c_at}).rowcount if measurements else 0
    stored = conn.execute(PRUNE_RESPONSES, {"at": c_at}).rowcount
    counts = {"events": events, "transitions": transitions, "leases": leases,
              "measurements": gone, "kv_peaks": peaks, "responses": stored}  # fmt: skip
    conn.execute(ADVANCE, {**args, "now": now, **counts})
    return Pruned(c, events, transitions, leases, gone, peaks, 0, stored)


class Pruner:
    """The writer process's pruning state: what is due, when a slice may run, slices that adapt to their time."""

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
        self._slices = 0
        #: no pruning at all before this (timer seconds): after a failure, or when stuck
        self._rest_until = 0.0
        #: no look at the age limit before this (timer seconds)
        self._age_quiet_until = 0.0
        #: since when pruning has been due without a pause (None: not due)
        self._due_since: float | None = None
        #: when the last slice that no live record waited for ended
        self._idle_slice_at = 0.0
        #: by size, pages in use this far over the target (set by due)
        self._behind_by_size = False
        #: seconds of pruning that may still run while records wait (earned at BUSY_SHARE of
        #: the time, at most one slice ahead; spent by those slices)
        self._credit = 0.0
        self._credit_at: float | None = None
        self._incremental: bool | None = None
        #: the connection's synchronous setting, put back after each slice's commit
        self._synchronous = 2
        #: pruned since the last idle checkpoint
        self.dirty = False
        #: a line for the log, once, when pruning cannot get the file under max_mb
        self.note: str | None = None
        self._noted = False

    def setup(self, conn: sqlite3.Connection) -> None:
        """The writer's connection: checkpoint the WAL, and cut it back, at :attr:`Policy.wal_bytes`."""
        wal = self.policy.wal_bytes
        conn.execute(f"PRAGMA wal_autocheckpoint = {max(16, wal // _pragma(conn, 'page_size'))}")
        conn.execute(f"PRAGMA journal_size_limit = {wal}")
        self._synchronous = _pragma(conn, "synchronous")

    def idle(self, conn: sqlite3.Connection) -> None:
        """After pruning, once the writer is quiet (:data:`QUIET_S`): a checkpoint to shrink the files.

        ``TRUNCATE`` with no busy wait: if a reader holds an old snapshot, it does
        what it can now (like ``PASSIVE``) and the next checkpoint does the rest.
        """
        if not self.dirty:
            return
        self.dirty = False
        busy = _pragma(conn, "busy_timeout")
        conn.execute("PRAGMA busy_timeout = 0")
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error:
            pass  # the next checkpoint tries again
        finally:
            conn.execute(f"PRAGMA busy_timeout = {busy}")

    def due(self, conn: sqlite3.Connection) -> bool:
        """Cheap: is there pruning or vacuuming to do now? (The age limit is looked at once a second.)"""
        now = self._timer()
        if not self.policy.enabled or now < self._rest_until:
            return self._not_due()
        sized = self.policy.max_bytes > 0
        used = used_bytes(conn) if sized else 0
        self._behind_by_size = sized and used > self._behind_bytes()
        if (sized and used > self.policy.target_bytes) or self._vacuum_due(conn):
            return self._is_due(now)
        cutoff = self._cutoff()
        if cutoff is not None and now >= self._age_quiet_until:
            first = conn.execute(
                "SELECT at FROM events WHERE seq > ? ORDER BY seq LIMIT 1", (pruned_through(conn),)
            ).fetchone()
            if first is not None and first[0] < cutoff:
                return self._is_due(now)
            self._age_quiet_until = now + AGE_CHECK_S
        return self._not_due()

    def _is_due(self, now: float) -> bool:
        if self._due_since is None:
            self._due_since = now
        return True

    def _not_due(self) -> bool:
        self._due_since = None
        return False

    def may_run(self, waiting: bool) -> bool:
        """A due slice may run now: always when no live record waits (``waiting`` False);
        with records waiting only when pruning is behind, within :data:`BUSY_SHARE` of the time."""
        if not waiting:
            return True
        now = self._timer()
        earned = (now - self._credit_at) * BUSY_SHARE if self._credit_at is not None else 0.0
        self._credit, self._credit_at = min(SLICE_S, self._credit + earned), now
        since = None if self._due_since is None else max(self._due_since, self._idle_slice_at)
        starved = since is not None and now - since >= BEHIND_S
        return (self._behind_by_size or starved) and self._credit >= 0.0

    def alone(self, conn: sqlite3.Connection, *, busy: bool = False) -> list[tuple[int, str]]:
        """A slice of about :data:`SLICE_S` in a transaction of its own, committed without an fsync.

        ``busy``: live records wait for it (its time is charged to :data:`BUSY_SHARE`).
        Returns lines for the log.
        """
        t0 = self._timer()
        conn.execute("PRAGMA synchronous = NORMAL")
        try:
            conn.execute("BEGIN IMMEDIATE")
            self.slice(conn, SLICE_S)
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            self._failed(e)
        finally:
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
        if busy:
            self._credit -= self._timer() - t0
        else:
            self._idle_slice_at = self._timer()
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
        self._rest_until = self._timer() + STUCK_REST_S

    def slice(self, conn: sqlite3.Connection, budget_s: float) -> Pruned | None:
        """One slice inside the caller's transaction; None if nothing was due.

        About ``budget_s`` long: the events per slice adapt to the time taken,
        and the vacuum stops at the budget.
        """
        t0 = self._timer()
        pruned = self._prune(conn, self.batch)
        took = self._timer() - t0
        if pruned is not None:
            self._adapt(took, budget_s)
        vacuumed = 0
        if took < budget_s and self._vacuum_due(conn):
            vacuumed = self._vacuum(conn, t0 + budget_s)
        if pruned is None and not vacuumed:
            return None
        self.dirty = True
        if pruned is None:
            return Pruned(pruned_through(conn), 0, 0, 0, 0, 0, vacuumed)
        return replace(pruned, vacuumed_pages=vacuumed)

    # -- internals --

    def _cutoff(self) -> float | None:
        days = self.policy.retain_days
        return self._clock() - days * 86400.0 if days > 0 else None

    def _over_size(self, conn: sqlite3.Connection) -> bool:
        return self.policy.max_bytes > 0 and used_bytes(conn) > self.policy.target_bytes

    def _behind_bytes(self) -> int:
        return self.policy.target_bytes + int(self.policy.max_bytes * BEHIND_SHARE)

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

        The excess over the target less :data:`HYSTERESIS_SHARE` of max_mb, over
        the average bytes per sequence number still kept: a slice then prunes
        what is needed, not a whole batch, so the journal keeps as much history
        as fits, and the next slice is not due after the next commit already.
        """
        last = conn.execute("SELECT max(seq) FROM events").fetchone()[0] or p
        used = used_bytes(conn)
        per_seq = used / max(1, last - p)
        goal = self.policy.target_bytes - int(self.policy.max_bytes * HYSTERESIS_SHARE)
        return max(MIN_BATCH, int((used - goal) / per_seq) + 1)

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

    def _vacuum(self, conn: sqlite3.Connection, deadline: float) -> int:
        """Give free pages beyond the slack back, one per statement, until ``deadline``."""
        page = _pragma(conn, "page_size")
        excess = _pragma(conn, "freelist_count") - self.policy.slack_bytes // page
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
