"""The journal's one writer thread: group commit, per-row rejection, retry with backoff.

Theory of operation
-------------------
:class:`Writer` owns a thread and the only writing connection to the journal
file. It knows nothing about Trio or about what the rows mean: the owner
(:class:`mlxd.journal.Journal`) puts :class:`Item` s (a sequence number and an
opaque record) on its queue in sequence order, and gives it two functions that
turn records into SQL, both run on the writer thread: ``plan`` turns a whole
batch into a :class:`Plan` (multi-row INSERTs, then UPDATEs that must each
change one row), ``prepare`` turns one record into its statements (the
reference, used record by record when a batch is refused). The writer hears
back through a :class:`Listener` whose methods it schedules with ``notify``
(``TrioToken.run_sync_soon``), so they run on the owner's thread, in order.

The loop, in the writer thread:

1. open the file (:func:`mlxd.migrate.open_database`), holding an exclusive
   ``flock`` on ``<journal>.lock`` so a second daemon on the same file fails
   at once instead of interleaving sequence numbers; migrate; report the
   highest seq (``on_ready``);
2. block for the first queued item, then drain everything queued behind it
   (up to :data:`MAX_BATCH`) into ONE ``BEGIN IMMEDIATE ... COMMIT``: a burst
   of N records costs one commit (:attr:`Writer.commits` counts them), written
   with the batch's :class:`Plan` in a few multi-row statements;
3. on success report the batch (``on_batch``); if a row is rejected by a
   constraint (it can never succeed), redo the batch with ``prepare`` and one
   savepoint per record, leaving out only the rejected ones;
4. on any other ``sqlite3.Error`` (locked past ``busy_timeout``, disk full,
   I/O error) roll back, keep every row queued in order, mark unhealthy
   (``on_failure``) and retry after an exponential backoff; the next commit
   writes them all and marks healthy again;
5. a :class:`Call` runs a function on the writer's connection between batches
   (start-up recovery uses it); ``stop()`` flushes what is queued and ends the
   thread; ``abandon()`` ends it without flushing (shutdown deadline passed).

Why multi-row statements: each ``sqlite3_step`` releases and retakes the GIL,
and the event loop wants it all the time, so a statement per row cost a thread
hand-off per row; a multi-row INSERT costs one per 64 rows. The SQLite work
itself runs without the GIL, on the other core.

``healthy``, ``last_error``, ``attempt_failures`` and ``commits`` are written
by the writer thread only and read anywhere (single attribute loads).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import queue
import sqlite3
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple, Protocol

from mlxd.errors import JournalError
from mlxd.faults import crash_point
from mlxd.migrate import Synchronous, migrate, open_database

log = logging.getLogger("mlxd.journal")

#: At most this many records go into one transaction.
MAX_BATCH = 1000

#: At most this many rows go into one multi-row INSERT (10 columns x 64 stays under
#: SQLite's oldest limit of 999 bound parameters).
MAX_ROWS_PER_INSERT = 64

#: (sql, params, must change exactly one row); an INSERT's sql is ``... VALUES (?, ...)``
Op = tuple[str, tuple[Any, ...], bool]


@functools.lru_cache(maxsize=128)
def _multi_row(sql: str, rows: int) -> str:
    """``INSERT ... VALUES (?, ?)`` for ``rows`` rows at once (sizes are powers of two: few distinct)."""
    head, sep, values = sql.partition(" VALUES ")
    assert sep and head.startswith("INSERT"), sql
    return head + sep + ", ".join([values] * rows)


class Item(NamedTuple):
    """One journal record as the owner queues it: its sequence number and what to write."""

    seq: int
    #: opaque to the writer: the owner's ``plan``/``prepare`` turn it into statements
    record: Any


class Plan(NamedTuple):
    """How to write a whole batch: what ``plan`` returns."""

    #: (INSERT ... VALUES (?, ...), rows): written as multi-row INSERTs, in this order
    inserts: list[tuple[str, list[tuple[Any, ...]]]]
    #: (UPDATE ..., rows): one statement per row, each must change exactly one row
    updates: list[tuple[str, list[tuple[Any, ...]]]]
    #: (seq, what to publish) for the records that have an ``events`` row
    published: list[tuple[int, Any]]


#: what ``prepare`` returns for one record: its statements and what to publish (or None)
Prepared = tuple[tuple[Op, ...], Any]


@dataclass(frozen=True, slots=True)
class Call:
    """A function to run on the writer's connection, in queue order."""

    fn: Callable[[sqlite3.Connection], Any]
    future: Future[Any]


class Listener(Protocol):
    """What the writer tells its owner (each call runs on the owner's thread, in order)."""

    def on_ready(self, max_seq: int) -> None: ...
    def on_batch(
        self,
        last: int,
        published: list[tuple[int, Any]],
        rejected: list[tuple[int, str]],
    ) -> None: ...
    def on_failure(self) -> None: ...
    def on_exit(self) -> None: ...


class Rejected(Exception):
    """A row the database will never take (retrying cannot help)."""


_REJECTABLE = (
    sqlite3.IntegrityError,
    sqlite3.DataError,
    sqlite3.ProgrammingError,
    sqlite3.InterfaceError,
    Rejected,
)

_STOP = object()


class Writer:
    def __init__(
        self,
        path: Path,
        listener: Listener,
        notify: Callable[..., None],
        plan: Callable[[list[Item]], Plan],
        prepare: Callable[[Item], Prepared],
        *,
        synchronous: Synchronous,
        busy_timeout_ms: int,
        retry_initial: float,
        retry_max: float,
        migrations: Path | None,
    ) -> None:
        self.path = path
        self._listener = listener
        self._notify = notify
        self._plan = plan
        self._prepare = prepare
        self._synchronous: Synchronous = synchronous
        self._busy_timeout_ms = busy_timeout_ms
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._migrations = migrations
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._abandon = threading.Event()
        self._lock_file: IO[str] | None = None
        self._thread = threading.Thread(target=self._main, name="mlxd-journal", daemon=True)
        #: set when opening failed (a JournalError or ConfigError for the owner to raise)
        self.open_error: BaseException | None = None
        #: set when the loop died of an unexpected error (a bug)
        self.error: BaseException | None = None
        self.healthy = True
        self.last_error: str | None = None
        self.attempt_failures = 0
        self.commits = 0

    # ---- the owner's side -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def put(self, item: Item) -> None:
        self._queue.put(item)

    def call(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run ``fn(conn)`` on the writer thread after what is queued; blocks for its result."""
        future: Future[Any] = Future()
        self._queue.put(Call(fn, future))
        return future.result()

    def stop(self) -> None:
        """Flush what is queued, then end the thread (``on_exit``)."""
        self._queue.put(_STOP)

    def abandon(self) -> None:
        """End the thread at its next retry without writing what is left."""
        self._abandon.set()

    def join(self, timeout: float) -> bool:
        """Wait for the thread to end (after ``on_exit`` it only has to return); True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the thread -----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            conn = self._open()
            max_seq = conn.execute(
                "SELECT max(coalesce((SELECT max(seq) FROM events), 0),"
                " coalesce((SELECT max(seq) FROM transitions), 0))"
            ).fetchone()[0]
        except BaseException as e:
            if isinstance(e, sqlite3.Error):
                e = JournalError(f"journal: cannot open {self.path}: {e}")
            self.open_error = e
            self._release_lock()
            self._notify(self._listener.on_ready, 0)
            self._notify(self._listener.on_exit)
            return
        self._notify(self._listener.on_ready, int(max_seq))
        try:
            self._loop(conn)
        except BaseException as e:  # a bug: the owner re-raises it
            self.error = e
            log.exception("journal: writer thread died")
        finally:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
            self._release_lock()
            self._notify(self._listener.on_exit)

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(self.path.with_name(self.path.name + ".lock"), "a+")  # noqa: SIM115
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            lock.close()
            raise JournalError(
                f"journal: {self.path} is in use by another mlxd (pid {holder})"
            ) from None
        self._lock_file = lock
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        conn = open_database(
            self.path, synchronous=self._synchronous, busy_timeout_ms=self._busy_timeout_ms
        )
        try:
            migrate(conn, self._migrations)
        except BaseException:
            conn.close()
            raise
        return conn

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            with contextlib.suppress(OSError):
                self._lock_file.close()  # closing the file drops the flock
            self._lock_file = None

    def _loop(self, conn: sqlite3.Connection) -> None:
        pending: deque[Any] = deque()
        stopping = False
        backoff = self._retry_initial
        while True:
            if not pending:
                if stopping:
                    return
                pending.append(self._queue.get())
            while len(pending) < MAX_BATCH:
                try:
                    pending.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            head = pending[0]
            if head is _STOP:
                pending.popleft()
                stopping = True
                continue
            if isinstance(head, Call):
                pending.popleft()
                self._run_call(conn, head)
                continue
            batch: list[Item] = []
            for item in pending:
                if not isinstance(item, Item) or len(batch) >= MAX_BATCH:
                    break
                batch.append(item)
            try:
                published, rejected = self._commit(conn, batch)
            except sqlite3.Error as e:
                self.healthy = False
                self.last_error = f"{type(e).__name__}: {e}"
                self.attempt_failures += 1
                self._notify(self._listener.on_failure)
                log.warning("journal: write failed (%s); retrying in %.2fs", e, backoff)
                if self._abandon.wait(backoff):
                    return
                backoff = min(backoff * 2, self._retry_max)
                continue
            for _ in batch:
                pending.popleft()
            if not self.healthy:
                log.warning("journal: writing again after: %s", self.last_error)
                self.healthy = True
            backoff = self._retry_initial
            self._notify(self._listener.on_batch, batch[-1].seq, published, rejected)

    def _run_call(self, conn: sqlite3.Connection, call: Call) -> None:
        try:
            result = call.fn(conn)
        except BaseException as e:
            self._rollback(conn)
            call.future.set_exception(e)
        else:
            self.commits += 1
            call.future.set_result(result)

    @staticmethod
    def _apply(conn: sqlite3.Connection, ops: tuple[Op, ...]) -> None:
        for sql, params, must_change in ops:
            cur = conn.execute(sql, params)
            if must_change and cur.rowcount != 1:
                raise Rejected(f"no open row to update ({sql.split()[1]} {params[-1]!r})")

    @staticmethod
    def _write(conn: sqlite3.Connection, plan: Plan) -> None:
        """Carry out a :class:`Plan`: multi-row INSERTs (powers of two up to 64 rows), then UPDATEs."""
        for sql, rows in plan.inserts:
            done, n = 0, len(rows)
            while done < n:
                k = min(MAX_ROWS_PER_INSERT, 1 << ((n - done).bit_length() - 1))
                conn.execute(_multi_row(sql, k), [v for row in rows[done : done + k] for v in row])
                done += k
        for sql, rows in plan.updates:
            for params in rows:
                if conn.execute(sql, params).rowcount != 1:
                    raise Rejected(f"no open row to update ({sql.split()[1]} {params[-1]!r})")

    def _commit(
        self, conn: sqlite3.Connection, batch: list[Item]
    ) -> tuple[list[tuple[int, Any]], list[tuple[int, str]]]:
        """Write ``batch`` in one transaction; returns what to publish and the (seq, why) rejected."""
        try:
            plan = self._plan(batch)
            conn.execute("BEGIN IMMEDIATE")
            self._write(conn, plan)
            crash_point("journal.before_commit")
            conn.execute("COMMIT")
            crash_point("journal.after_commit")
        except _REJECTABLE:
            self._rollback(conn)
            return self._commit_isolated(conn, batch)
        except BaseException:
            self._rollback(conn)
            raise
        self.commits += 1
        return plan.published, []

    def _commit_isolated(
        self, conn: sqlite3.Connection, batch: list[Item]
    ) -> tuple[list[tuple[int, Any]], list[tuple[int, str]]]:
        """Like :meth:`_commit`, record by record in order, each in a savepoint; drops the rejected."""
        rejected: list[tuple[int, str]] = []
        published: list[tuple[int, Any]] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            for item in batch:
                ops, publish = self._prepare(item)
                conn.execute("SAVEPOINT record")
                try:
                    self._apply(conn, ops)
                except _REJECTABLE as e:
                    conn.execute("ROLLBACK TO record")
                    rejected.append((item.seq, f"{type(e).__name__}: {e}"))
                    log.error("journal: seq %d rejected: %s", item.seq, e)
                else:
                    if publish is not None:
                        published.append((item.seq, publish))
                conn.execute("RELEASE record")
            crash_point("journal.before_commit")
            conn.execute("COMMIT")
            crash_point("journal.after_commit")
        except BaseException:
            self._rollback(conn)
            raise
        self.commits += 1
        return published, rejected

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
