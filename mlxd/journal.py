"""The SQLite journal: one writer thread, group commit, a commit watermark, crash recovery.

Theory of operation
-------------------
The daemon owns one :class:`Journal` and starts it with
``await nursery.start(journal.run)``. ``run()`` starts ONE dedicated writer
thread (:class:`mlxd.journal_writer.Writer`), which opens the file (WAL,
``synchronous`` FULL or NORMAL, foreign keys, ``busy_timeout``), applies the
migrations, reads the highest sequence number and reports ready; only then
does ``run()`` call ``task_status.started()``. The thread owns its
connection; nothing else writes.

Then, once, the daemon calls :meth:`Journal.begin_run` (synchronous; it waits
for the writer thread to do the work, a few milliseconds at start-up, before any
request is served). It inserts this run's ``runs`` row and repairs what the
previous run left behind, in one transaction with that row (see
:class:`RecoveryReport`).

From Trio, :meth:`Journal.record` never blocks: it assigns the next journal
sequence number and puts the row(s) on the writer's queue. The writer drains
everything queued into one transaction, so a burst of N records costs one
commit. After each commit it tells the Trio side, which moves the *watermark*
(every seq up to it is on disk) and wakes :meth:`Journal.wait_committed`
callers and delivers the committed events to subscribers.

Sequence numbers: one Python-side counter, initialised from the file's highest
seq. Every record and :meth:`end_run` takes the next number; a transition's
``transitions.seq`` equals its ``events.seq``; measurements and the end of a
run take a number but have no ``events`` row, so ids are increasing, not dense.

When a write fails (disk full, I/O error, the file locked past
``busy_timeout``...), the transaction rolls back, the rows stay queued in order,
:attr:`Journal.healthy` turns false with :attr:`Journal.last_error`, and the
writer retries with exponential backoff; the first successful commit writes
them all and turns ``healthy`` true again. A row the database rejects for what
it is (a constraint: duplicate lease id, unknown lease, bad vocabulary) cannot
succeed on retry: it alone is left out, the rest of its batch commits, and
``wait_committed`` on its seq raises :class:`~mlxd.errors.JournalError`.

Readers (:meth:`history`, :meth:`leases`, :meth:`events_after`,
:meth:`latest_measurements`) open their own read-only connection per call.

Live events: :meth:`subscribe` returns a :class:`Subscription` with a bounded
buffer, fed only after commit. A subscriber that falls behind is dropped
(``dropped`` set, iteration ends after its buffered events) rather than
slowing anyone down. The SSE recipe without loss: subscribe first, send
``events_after(last_event_id)``, then the subscription's events whose seq is
higher than the last one sent; when it ends with ``dropped``, repeat.

Shutdown: the daemon calls :meth:`end_run` (clean or not) and cancels
``run()``, which flushes the queue and joins the thread, waiting at most
``flush_timeout`` seconds (shielded, bounded); rows still unwritten after that
are reported in the log and lost, like any write after a crash.
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from enum import Enum
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any, NamedTuple

import trio

from mlxd import history as reads
from mlxd.errors import JournalError
from mlxd.events import (
    LeaseAcquired,
    LeaseReleased,
    ManagerEvent,
    MeasurementEvent,
    TransitionEvent,
)
from mlxd.faults import crash_point
from mlxd.journal_writer import Item, Op, Plan, Prepared, Rejected, Writer
from mlxd.migrate import Synchronous, open_readonly
from mlxd.states import HOLDS_MEMORY, Outcome, Reason, State

log = logging.getLogger("mlxd.journal")

#: States that count as "resident" for restore_on_start.
RESIDENT: frozenset[State] = frozenset({State.LOADED, State.DRAINING})

_INSERT_EVENT = (
    "INSERT INTO events(seq, run_id, at, kind, model, payload) VALUES (?, ?, ?, ?, ?, ?)"
)
_INSERT_TRANSITION = (
    "INSERT INTO transitions(seq, run_id, at, model, from_state, to_state, reason, memory_bytes,"
    " error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_INSERT_LEASE = (
    "INSERT INTO leases(id, run_id, model, request_id, route, acquired_at, released_at, outcome,"
    " prompt_tokens, completion_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_RELEASE_LEASE = (
    "UPDATE leases SET released_at = ?, outcome = ?, prompt_tokens = ?, completion_tokens = ?"
    " WHERE id = ? AND released_at IS NULL"
)
_INSERT_MEASUREMENT = (
    "INSERT INTO measurements(model, at, memory_bytes, load_seconds) VALUES (?, ?, ?, ?)"
)
_END_RUN = "UPDATE runs SET stopped_at = ?, clean_stop = ? WHERE id = ?"


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What :meth:`Journal.begin_run` found and repaired.

    ``resident``: the models that were resident (state ``loaded`` or
    ``draining``) at the end of the previous run, oldest transition first: for
    a crashed run, their last state; for a run that shut down, the state each
    model had before its first ``shutdown`` row of that run. These are what
    ``restore_on_start`` loads again. ``recovered``: the ``(model, state)``
    pairs that got a ``<state> -> unloaded`` row with reason
    ``crash_recovery`` (every model whose last state holds memory; after a
    clean stop there are normally none). ``interrupted_leases``: the leases
    left open, now closed with outcome ``interrupted`` at this start's time.
    """

    run_id: int
    previous_run_id: int | None
    crashed: bool
    resident: tuple[str, ...]
    recovered: tuple[tuple[str, State], ...]
    interrupted_leases: tuple[str, ...]


_ENCODER = json.JSONEncoder(separators=(",", ":"))
_STR = encode_basestring_ascii
_INF = float("inf")


def _json(payload: dict[str, Any]) -> str:
    return _ENCODER.encode(payload)


_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in fields(cls))
    for cls in (TransitionEvent, LeaseAcquired, LeaseReleased, MeasurementEvent)
}


def _payload(event: ManagerEvent) -> dict[str, Any]:
    """``event.as_dict()`` as JSON gives it back (enums as strings), without asdict's deep copy."""
    out: dict[str, Any] = {"kind": event.kind}
    for name in _FIELDS[type(event)]:
        value = getattr(event, name)
        out[name] = value.value if isinstance(value, Enum) else value
    return out


def _value_json(v: Any) -> str:
    """One value exactly as ``json.dumps`` writes it (ASCII, compact)."""
    if v is None:
        return "null"
    if isinstance(v, str):  # enums are StrEnums: their value
        return _STR(v)
    t = type(v)
    if t is int:
        return int.__repr__(v)
    if t is float and -_INF < v < _INF:
        return float.__repr__(v)
    return _ENCODER.encode(v)  # bools, NaN, anything else: json's own rules


#: per event type: one getter for all its fields, and the ``"name":`` prefix of each
_SHAPES: dict[type, tuple[Callable[[Any], tuple[Any, ...]], str, tuple[str, ...]]] = {
    cls: (
        operator.attrgetter(*names),
        '{"kind":' + _STR(cls.kind) + ",",  # type: ignore[attr-defined]
        tuple(_STR(n) + ":" for n in names),
    )
    for cls, names in _FIELDS.items()
}


def _event_json(event: ManagerEvent) -> str:
    """``json.dumps(_payload(event))`` (compact), written directly: the writer's hot path.

    It follows the dataclass fields, so a new field cannot be left out; the
    journaled property test compares every stored payload with ``json.dumps``.
    """
    get, head, prefixes = _SHAPES[type(event)]
    values = get(event)
    return (
        head + ",".join([p + _value_json(v) for p, v in zip(prefixes, values, strict=True)]) + "}"
    )


def _event_row(seq: int, run_id: int, ev: ManagerEvent) -> tuple[Any, ...]:
    return (seq, run_id, ev.at, ev.kind, ev.model, _event_json(ev))


def _transition_row(seq: int, run_id: int, ev: TransitionEvent) -> tuple[Any, ...]:
    return (
        seq, run_id, ev.at, ev.model, ev.from_state.value, ev.to_state.value, ev.reason.value,
        ev.memory_bytes, ev.error,
    )  # fmt: skip


def _lease_row(run_id: int, ev: LeaseAcquired) -> list[Any]:
    return [ev.lease_id, run_id, ev.model, ev.request_id, ev.route, ev.at, None, None, None, None]


def _release_row(ev: LeaseReleased) -> tuple[Any, ...]:
    return (ev.at, ev.outcome.value, ev.prompt_tokens, ev.completion_tokens, ev.lease_id)


class _EndRun(NamedTuple):
    at: float
    clean: bool


# ---- from records to SQL (both run on the writer thread) ---------------------------------------


def _prepare(item: Item) -> Prepared:
    """One record's statements, in order, and what to publish: the reference for :func:`_plan`."""
    run_id, ev = item.record
    if isinstance(ev, _EndRun):
        return ((_END_RUN, (ev.at, 1 if ev.clean else 0, run_id), True),), None
    if isinstance(ev, MeasurementEvent):
        return (
            (_INSERT_MEASUREMENT, (ev.model, ev.at, ev.memory_bytes, ev.load_seconds), False),
        ), None
    event_op: Op = (_INSERT_EVENT, _event_row(item.seq, run_id, ev), False)
    if isinstance(ev, TransitionEvent):
        return (event_op, (_INSERT_TRANSITION, _transition_row(item.seq, run_id, ev), False)), ev
    if isinstance(ev, LeaseAcquired):
        return ((_INSERT_LEASE, tuple(_lease_row(run_id, ev)), False), event_op), ev
    return ((_RELEASE_LEASE, _release_row(ev), True), event_op), ev


def _plan(items: list[Item]) -> Plan:
    """A batch in a few multi-row statements, with the same end state as :func:`_prepare` in order.

    A lease acquired and released within the batch is one ``leases`` row (no
    UPDATE). Anything unusual (a lease id acquired twice) raises
    :class:`Rejected`, which sends the batch record by record through
    :func:`_prepare`, where the database judges each record alone.
    """
    events: list[tuple[Any, ...]] = []
    transitions: list[tuple[Any, ...]] = []
    leases: dict[str, list[Any]] = {}
    releases: list[tuple[Any, ...]] = []
    measurements: list[tuple[Any, ...]] = []
    ends: list[tuple[Any, ...]] = []
    published: list[tuple[int, Any]] = []
    for seq, (run_id, ev) in items:
        t = type(ev)
        if t is LeaseAcquired:
            if ev.lease_id in leases:
                raise Rejected(f"lease {ev.lease_id!r} acquired twice in one batch")
            leases[ev.lease_id] = _lease_row(run_id, ev)
        elif t is LeaseReleased:
            row = leases.get(ev.lease_id)
            if row is not None and row[7] is None:  # acquired in this batch and still open
                row[6:10] = _release_row(ev)[:4]
            else:
                releases.append(_release_row(ev))
        elif t is TransitionEvent:
            transitions.append(_transition_row(seq, run_id, ev))
        elif t is MeasurementEvent:
            measurements.append((ev.model, ev.at, ev.memory_bytes, ev.load_seconds))
            continue
        else:
            ends.append((ev.at, 1 if ev.clean else 0, run_id))
            continue
        events.append(_event_row(seq, run_id, ev))
        published.append((seq, ev))
    inserts = [
        (_INSERT_EVENT, events),  # before transitions: their seq references it
        (_INSERT_TRANSITION, transitions),
        (_INSERT_LEASE, [tuple(r) for r in leases.values()]),
        (_INSERT_MEASUREMENT, measurements),
    ]
    updates = [(_RELEASE_LEASE, releases), (_END_RUN, ends)]
    return Plan(
        [(sql, rows) for sql, rows in inserts if rows],
        [(sql, rows) for sql, rows in updates if rows],
        published,
    )


class Subscription:
    """Committed journal events ``(seq, payload)`` as an async iterator; see the module doc."""

    def __init__(self, journal: Journal, buffer: int) -> None:
        self._journal = journal
        self._send, self._receive = trio.open_memory_channel[tuple[int, dict[str, Any]]](buffer)
        #: True when the journal dropped this subscriber for falling behind.
        self.dropped = False
        #: the seq of the last event this iterator returned
        self.last_seq: int | None = None

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> tuple[int, dict[str, Any]]:
        try:
            seq, payload = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None
        self.last_seq = seq
        return seq, payload

    def _offer(self, seq: int, payload: dict[str, Any]) -> bool:
        """Hand over one event; False (and dropped) when the buffer is full."""
        try:
            self._send.send_nowait((seq, dict(payload)))
        except trio.WouldBlock:
            self.dropped = True
            self._send.close()
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    def close(self) -> None:
        self._journal._subscribers.discard(self)
        self._send.close()
        self._receive.close()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Journal:
    """The daemon's journal. Construct, ``await nursery.start(journal.run)``, then ``begin_run``."""

    def __init__(
        self,
        path: Path | str,
        *,
        synchronous: Synchronous = "full",
        wall_clock: Callable[[], float] = time.time,
        busy_timeout_ms: int = 5000,
        flush_timeout: float = 10.0,
        retry_initial: float = 0.05,
        retry_max: float = 5.0,
        subscriber_buffer: int = 1024,
        migrations: Path | None = None,
    ) -> None:
        self.path = Path(path).expanduser()
        self.synchronous: Synchronous = synchronous
        self._wall_clock = wall_clock
        self._busy_timeout_ms = busy_timeout_ms
        self._flush_timeout = flush_timeout
        self._subscriber_buffer = subscriber_buffer
        self._token: trio.lowlevel.TrioToken | None = None
        self._writer = Writer(
            self.path,
            self,
            self._notify,
            _plan,
            _prepare,
            synchronous=synchronous,
            busy_timeout_ms=busy_timeout_ms,
            retry_initial=retry_initial,
            retry_max=retry_max,
            migrations=migrations,
        )
        self._ready = trio.Event()
        self._exited = trio.Event()
        #: the last seq handed out; invariant: _committed <= _last_seq
        self._last_seq = 0
        #: the watermark: every seq <= it is committed (or was rejected)
        self._committed = 0
        self._rejected: dict[int, str] = {}
        self._progress = trio.Event()
        self._running = False
        self._closed = False
        self._run_id: int | None = None
        self._run_ended = False
        self._subscribers: set[Subscription] = set()

    # ---- state --------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """False while writes fail (rows are kept and retried); true again after a commit."""
        return self._writer.healthy

    @property
    def last_error(self) -> str | None:
        """The last write failure (kept after recovery, for the record)."""
        return self._writer.last_error

    @property
    def commit_count(self) -> int:
        """Transactions committed by the writer (group commit keeps it far below the records)."""
        return self._writer.commits

    @property
    def run_id(self) -> int | None:
        return self._run_id

    @property
    def last_seq(self) -> int:
        """The last sequence number handed out."""
        return self._last_seq

    @property
    def committed_seq(self) -> int:
        """The watermark: every sequence number up to it is written (or was rejected)."""
        return self._committed

    # ---- lifecycle ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open, migrate and start the writer thread; on cancellation flush and join it."""
        if self._token is not None:
            raise RuntimeError("Journal.run() may be called only once")
        self._token = trio.lowlevel.current_trio_token()
        self._writer.start()
        try:
            await self._ready.wait()
            if self._writer.open_error is not None:
                raise self._writer.open_error
            self._running = True
            task_status.started()
            await self._exited.wait()
            # The writer only stops by itself on an unexpected error (a bug): surface it.
            raise JournalError(
                f"journal: writer thread stopped: {self._writer.error!r}"
            ) from self._writer.error
        finally:
            self._running = False
            await self._shutdown()

    async def _shutdown(self) -> None:
        self._writer.stop()
        with trio.move_on_after(self._flush_timeout) as scope:
            scope.shield = True
            await self._exited.wait()
        if self._exited.is_set():
            self._writer.join(1.0)  # it has reported its exit: only the return is left
        else:
            self._writer.abandon()
            log.error(
                "journal: gave up flushing after %.1fs; %d records not written (%s)",
                self._flush_timeout,
                self._last_seq - self._committed,
                self._writer.last_error,
            )
        self._closed = True
        for sub in list(self._subscribers):
            sub._send.close()
        self._subscribers.clear()
        self._wake()

    def begin_run(self, pid: int, version: str, config_path: str | None) -> RecoveryReport:
        """Insert this run's row and repair the previous run; call once after ``run()`` started.

        Blocks the caller while the writer thread does it (start-up only, before
        any record). Raises :class:`JournalError` if the file cannot be written.
        """
        if not self._running:
            raise RuntimeError("begin_run() needs the journal running (await nursery.start(run))")
        if self._run_id is not None:
            raise RuntimeError("begin_run() may be called only once")
        first = self._last_seq + 1
        report: RecoveryReport
        published: list[tuple[int, ManagerEvent]]
        try:
            report, published = self._writer.call(
                lambda conn: self._recover(conn, pid, version, config_path, first)
            )
        except sqlite3.Error as e:
            raise JournalError(f"journal: cannot start a run in {self.path}: {e}") from e
        self._run_id = report.run_id
        if published:
            self._last_seq = published[-1][0]
        self._committed = self._last_seq
        self._publish(published)
        return report

    def end_run(self, clean: bool) -> int:
        """Stamp this run's ``stopped_at`` and ``clean_stop``; queued after every record."""
        run_id = self._check_recording()
        seq = self._last_seq + 1
        self._writer.put(Item(seq, (run_id, _EndRun(self._wall_clock(), clean))))
        self._last_seq = seq
        self._run_ended = True
        return seq

    # ---- writing from Trio ----------------------------------------------------------------

    def record(self, event: ManagerEvent) -> int:
        """Queue ``event`` for the journal without blocking; returns its sequence number.

        Only the sequence number is taken here; the writer thread builds the
        rows and the JSON payload (:func:`_prepare`), off the event loop.
        Raises :class:`JournalError` once the journal is closed or the run ended.
        """
        run_id = self._check_recording()
        if type(event) not in _FIELDS:
            raise TypeError(f"not a journal event: {event!r}")
        seq = self._last_seq + 1
        self._writer.put(Item(seq, (run_id, event)))
        self._last_seq = seq
        return seq

    async def wait_committed(self, seq: int | None = None) -> None:
        """Return once ``seq`` (default: everything recorded so far) is committed.

        Raises :class:`JournalError` if the row was rejected, if an attempt to
        write it fails (it stays queued and is retried: wait again to see it
        land), or if the journal closes before writing it.
        """
        target = self._last_seq if seq is None else seq
        if target > self._last_seq:
            raise ValueError(f"seq {target} has not been recorded (the last is {self._last_seq})")
        failures = self._writer.attempt_failures
        while self._committed < target:
            if self._closed:
                raise JournalError(f"journal: closed before seq {target} was written")
            if self._writer.attempt_failures != failures:
                raise JournalError(f"journal: cannot write: {self._writer.last_error}")
            await self._progress.wait()
        if (why := self._rejected.get(target)) is not None:
            raise JournalError(f"journal: seq {target} was not written: {why}")

    def _check_recording(self) -> int:
        if self._closed or (self._run_id is not None and not self._running):
            raise JournalError("journal: closed")
        if self._run_id is None:
            raise RuntimeError("record() needs begin_run() first")
        if self._run_ended:
            raise JournalError("journal: this run has ended (end_run was called)")
        return self._run_id

    # ---- the writer's reports (run on the Trio thread, in order) ------------------------------

    def _notify(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    def _wake(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    def on_ready(self, max_seq: int) -> None:
        self._last_seq = self._committed = max_seq
        self._ready.set()

    def on_batch(
        self,
        last: int,
        published: list[tuple[int, ManagerEvent]],
        rejected: list[tuple[int, str]],
    ) -> None:
        self._committed = max(self._committed, last)
        self._rejected.update(rejected)
        self._publish(published)
        self._wake()

    def on_failure(self) -> None:
        self._wake()

    def on_exit(self) -> None:
        self._ready.set()
        self._exited.set()
        self._wake()

    def _publish(self, published: list[tuple[int, ManagerEvent]]) -> None:
        if not published or not self._subscribers:
            return  # payload dicts are built only for someone to read
        payloads = [(seq, _payload(event)) for seq, event in published]
        for sub in list(self._subscribers):
            for seq, payload in payloads:
                if not sub._offer(seq, payload):
                    self._subscribers.discard(sub)
                    break

    # ---- start-up recovery (runs on the writer thread) -------------------------------------

    def _recover(
        self, conn: sqlite3.Connection, pid: int, version: str, config_path: str | None, seq: int
    ) -> tuple[RecoveryReport, list[tuple[int, ManagerEvent]]]:
        now = self._wall_clock()
        conn.execute("BEGIN IMMEDIATE")
        prev = conn.execute("SELECT id, clean_stop FROM runs ORDER BY id DESC LIMIT 1").fetchone()
        prev_id, crashed = (None, False) if prev is None else (int(prev[0]), not prev[1])
        run_id = conn.execute(
            "INSERT INTO runs(started_at, pid, version, config_path) VALUES (?, ?, ?, ?)",
            (now, pid, version, config_path),
        ).lastrowid
        assert run_id is not None
        # Each model's last state (SQLite takes a bare column from the row holding the max).
        last = [
            (model, State(state))
            for model, state, _ in conn.execute(
                "SELECT model, to_state, max(seq) AS s FROM transitions GROUP BY model ORDER BY s"
            )
        ]
        before_shutdown = {
            model: State(state)
            for model, state, _ in conn.execute(
                "SELECT model, from_state, min(seq) FROM transitions"
                " WHERE run_id = ? AND reason = 'shutdown' GROUP BY model",
                (prev_id,),
            )
        }
        resident = tuple(m for m, s in last if before_shutdown.get(m, s) in RESIDENT)
        published: list[tuple[int, ManagerEvent]] = []
        recovered: list[tuple[str, State]] = []
        for model, state in last:
            if state not in HOLDS_MEMORY:
                continue
            ev = TransitionEvent(model, state, State.UNLOADED, Reason.CRASH_RECOVERY, now)
            conn.execute(_INSERT_EVENT, _event_row(seq, run_id, ev))
            conn.execute(_INSERT_TRANSITION, _transition_row(seq, run_id, ev))
            published.append((seq, ev))
            recovered.append((model, state))
            seq += 1
        interrupted: list[str] = []
        for lease_id, model in conn.execute(
            "SELECT id, model FROM leases WHERE released_at IS NULL AND run_id < ?"
            " ORDER BY acquired_at, rowid",
            (run_id,),
        ).fetchall():
            released = LeaseReleased(lease_id, model, Outcome.INTERRUPTED, now)
            conn.execute(_RELEASE_LEASE, _release_row(released))
            conn.execute(_INSERT_EVENT, _event_row(seq, run_id, released))
            published.append((seq, released))
            interrupted.append(lease_id)
            seq += 1
        crash_point("journal.before_commit")
        conn.execute("COMMIT")
        crash_point("journal.after_commit")
        report = RecoveryReport(
            run_id=int(run_id),
            previous_run_id=prev_id,
            crashed=crashed,
            resident=resident,
            recovered=tuple(recovered),
            interrupted_leases=tuple(interrupted),
        )
        return report, published

    # ---- readers (own read-only connection per call) ------------------------------------------

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
            return reads.read_transitions(conn, model=model, since=since, limit=limit)

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
            return reads.read_leases(
                conn, model=model, since=since, limit=limit, open_only=open_only
            )

    def events_after(self, seq: int, limit: int = 1000) -> list[dict[str, Any]]:
        """Committed events with a seq above ``seq`` (SSE resume from ``Last-Event-ID``)."""
        with self._reader() as conn:
            return reads.read_events_after(conn, seq, limit)

    def latest_measurements(self) -> dict[str, int]:
        """Each model's latest measured footprint in bytes (the memory estimate's second source)."""
        with self._reader() as conn:
            return reads.read_latest_measurements(conn)

    def subscribe(self, buffer: int | None = None) -> Subscription:
        """Live committed events; see :class:`Subscription` and the module doc for resuming."""
        if self._closed:
            raise JournalError("journal: closed")
        sub = Subscription(self, buffer or self._subscriber_buffer)
        self._subscribers.add(sub)
        return sub
