"""The journal's writer process: group commit, per-row rejection, retry with backoff.

Theory of operation
-------------------
The daemon (:class:`mlxd.journal.journal.Journal`) starts this module as a child
process (``python -c 'from mlxd.journal.writer import main; main()'``) and
talks to it over two pipes, the child's stdin and stdout, in length-prefixed
pickled tuples (:func:`frame`, :class:`Frames`). Why a process and not a
thread: CPython has one GIL per process, and a writer thread's Python work
(JSON payloads, row tuples, binding parameters) and every GIL hand-off came
out of the event loop's time; measured, it cost a saturated manager 35% of its
throughput. Out of process, the event loop only pickles plain tuples
(:mod:`mlxd.journal.rows`) and writes them to a pipe.

The daemon sends, in order:

* ``("open", Settings)`` once, first;
* ``("records", first_seq, run_id, [wire records])``: records numbered
  ``first_seq``, ``first_seq + 1``, ... (:func:`mlxd.journal.rows.encode`);
* ``("recover", pid, version, config_path, now, first_seq)``: start-up recovery
  (:func:`mlxd.journal.rows.recover`), run between batches, answered by
  ``("recovered", ok, report_and_rows_or_error)``;
* ``("replay_until", seq)``: after ``open``, from a daemon whose previous writer
  process died: records up to ``seq`` may be sent again. Those with an
  ``events`` row are resent only above the file's highest seq, but a
  measurement or a KV peak has none, so one already in the file is not inserted again;
* ``("stop",)``: write what is queued, then exit.

The child answers with ``("ready", max_seq, notes)`` (lines for the log) or ``("open_error", kind,
message)``, then ``("batch", last_seq, rejected, commits)`` after each commit
(every seq up to ``last_seq`` is written, except the ``(seq, why)`` rejected),
``("failure", last_error, attempt_failures)`` when an attempt fails,
``("note", logging level, line)`` for the daemon's log (retention), and
``("exit", error_or_None)`` last.

One thread in the child (a second thread would make every ``munmap`` of the
child a TLB-shootdown interrupt to the core the event loop runs on). It reads
its stdin without blocking (on Linux the pipe holds 1 MiB, so the daemon's
writes do not wait for an fsync), and:

1. opens the file (:func:`mlxd.journal.migrate.open_database`), holding two
   exclusive ``flock`` locks so that a second daemon on the same file fails at
   once instead of interleaving sequence numbers: one on ``<real
   path>.lock`` (the symlinks and ``..`` of the path resolved; it holds the
   daemon's pid: if that daemon is dead, its writer is finishing its last
   batch, and the new one waits for the lock up to ``lock_wait`` seconds),
   and one on the journal file itself, which a hard link (another name for
   the same inode) cannot escape; migrates; converts an older small file to
   incremental vacuum (:func:`mlxd.journal.retention.convert_at_start`);
   reports the highest seq;
2. waits for records, then takes everything that has arrived (up to
   :data:`MAX_BATCH` records) into ONE ``BEGIN IMMEDIATE ... COMMIT``: a burst
   of N records costs one commit, written with the batch's
   :func:`~mlxd.journal.rows.plan` in a few multi-row statements; retention
   prunes in slices of its own between those commits, only while no record
   waits unless it falls behind (:meth:`mlxd.journal.retention.Pruner.may_run`);
3. if a row is rejected by a constraint (it can never succeed), redoes the
   batch record by record, one savepoint each, leaving out only the rejected;
4. on any other ``sqlite3.Error`` (locked past ``busy_timeout``, disk full,
   I/O error) rolls back, keeps every record queued in order, reports the
   failure and retries after an exponential backoff (reading on meanwhile);
   the next commit writes them all.

Lifetime: the child ignores SIGINT, SIGTERM and SIGHUP (a terminal's Ctrl-C or
a service manager's signal to the whole group must not kill it before the
daemon's last rows are written); it ends when the daemon says ``stop`` or
closes the pipe. End of input without ``stop`` means the daemon died: the
child writes what it had already received, once, without retrying, and exits.
A crash point reached here (:mod:`mlxd.crash_points`) kills the daemon too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import select
import signal
import sqlite3
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

from mlxd import crash_points
from mlxd.crash_points import crash_point
from mlxd.errors import ConfigError, JournalError
from mlxd.framing import Frames, child_command, frame
from mlxd.journal import retention
from mlxd.journal.migrate import Synchronous, migrate, open_database
from mlxd.journal.rows import (
    WRITTEN_ALREADY,
    Item,
    Op,
    Plan,
    Rejected,
    Wire,
    plan,
    prepare,
    recover,
)

#: At most this many records go into one transaction (whole messages: it may be a little over).
MAX_BATCH = 1000

#: The pipe from the daemon holds this much on Linux (the default 64 KiB fills during a slow fsync).
PIPE_BYTES = 1 << 20

#: At most this many rows go into one multi-row INSERT (11 columns x 64 stays under
#: SQLite's oldest limit of 999 bound parameters).
MAX_ROWS_PER_INSERT = 64

# ---- the pipe protocol: frames (:mod:`mlxd.framing`) -------------------------------------------


@dataclass(frozen=True, slots=True)
class Settings:
    """What the daemon tells the writer process first."""

    path: str
    synchronous: Synchronous
    busy_timeout_ms: int
    retry_initial: float
    retry_max: float
    migrations: str | None
    #: the daemon's pid: written to the lock file, killed with the child at a crash point
    daemon_pid: int
    #: how long to wait for the lock of a dead daemon's writer to be released
    lock_wait: float = 10.0
    #: retention (journal.retain_days, journal.max_mb in bytes); 0 = no limit
    retain_days: float = 0.0
    max_bytes: int = 0


#: the ``open_error`` kinds the daemon turns back into exceptions
ERROR_KINDS: dict[str, type[Exception]] = {"config": ConfigError, "journal": JournalError}


# ---- the writer ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=128)
def _multi_row(sql: str, rows: int) -> str:
    """``INSERT ... VALUES (?, ?)`` for ``rows`` rows at once (sizes are powers of two: few distinct)."""
    head, sep, values = sql.partition(" VALUES ")
    assert sep and head.startswith("INSERT"), sql
    return head + sep + ", ".join([values] * rows)


class Chunk(NamedTuple):
    """Records as one ``records`` message brought them."""

    first: int
    run_id: int
    wires: list[Wire]


@dataclass(frozen=True, slots=True)
class Call:
    """A function to run on the writer's connection between batches; ``done(ok, value)`` after."""

    fn: Callable[[sqlite3.Connection], Any]
    done: Callable[[bool, Any], None]


_REJECTABLE = (
    sqlite3.IntegrityError,
    sqlite3.DataError,
    sqlite3.ProgrammingError,
    sqlite3.InterfaceError,
    Rejected,
)


class Inbox:
    """The daemon's messages from a non-blocking pipe, cut with :class:`Frames`."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        os.set_blocking(fd, False)
        if hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux: room for the records of a slow fsync
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._frames = Frames()
        #: the daemon closed its end
        self.closed = False

    def wait(self, timeout: float | None) -> list[tuple[Any, ...]]:
        """Messages that arrive within ``timeout`` seconds (None: until some do, or the end)."""
        if not self.closed:
            select.select([self._fd], [], [], timeout)
        return self.take()

    def take(self) -> list[tuple[Any, ...]]:
        """The messages already here, without waiting."""
        messages: list[tuple[Any, ...]] = []
        while not self.closed:
            try:
                data = os.read(self._fd, 1 << 20)
            except BlockingIOError:
                break
            if not data:
                self.closed = True
                break
            messages += self._frames.feed(data)
        return messages


class Writer:
    """The writer process's one thread: reads the daemon's messages, writes, reports."""

    def __init__(self, settings: Settings, send: Callable[[tuple[Any, ...]], None]) -> None:
        self.settings = settings
        self.path = Path(settings.path)
        self._send = send
        self._lock_file: IO[str] | None = None
        #: an open descriptor of the journal file, flocked (see take_lock)
        self._file_lock: int | None = None
        self._pending: deque[Chunk | Call] = deque()
        self._stopping = False
        #: the daemon is gone without saying stop: write what came once, no retries
        self._abandoned = False
        self.last_error: str | None = None
        #: (logging level, line) for the daemon's log, sent with ``ready``
        self.notes: list[tuple[int, str]] = []
        policy = retention.Policy(settings.retain_days, settings.max_bytes)
        self.pruner = retention.Pruner(policy) if policy.enabled else None
        #: how long an idle writer sleeps: with retention, time alone makes rows due
        self._idle_wait = retention.AGE_CHECK_S if self.pruner is not None else None
        self.attempt_failures = 0
        self.commits = 0
        #: records up to this seq may be in the file already (see ``replay_until``)
        self._replay_until = 0

    def run(self, inbox: Inbox) -> None:
        """Open the file, then write what the daemon sends until it says stop or goes away."""
        try:
            conn = self._open()
        except BaseException as e:
            kind = "config" if isinstance(e, ConfigError) else "journal"
            if not isinstance(e, ConfigError | JournalError):
                e = JournalError(f"journal: cannot open {self.path}: {e}")
            self._send(("open_error", kind, str(e)))
            self._release_lock()
            self._send(("exit", None))
            return
        error: str | None = None
        try:
            if self.pruner is not None:
                self.pruner.setup(conn)
            # Pruning may have removed the newest events: new rows still number after its
            # watermark, or the pruner would never reach them and replay misorder them.
            max_seq = conn.execute(
                "SELECT max(coalesce((SELECT max(seq) FROM events), 0),"
                " coalesce((SELECT max(seq) FROM transitions), 0))"
            ).fetchone()[0]
            max_seq = max(int(max_seq), retention.pruned_through(conn))
            self._send(("ready", max_seq, self.notes))
            self._loop(conn, inbox)
        except BaseException as e:  # a bug: the daemon reports it
            error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
            self._release_lock()
            self._send(("exit", error))

    def _open(self) -> sqlite3.Connection:
        s = self.settings
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_file, self._file_lock = take_lock(self.path, s.daemon_pid, s.lock_wait)
        conn = open_database(
            self.path, synchronous=s.synchronous, busy_timeout_ms=s.busy_timeout_ms
        )
        try:
            migrate(conn, Path(s.migrations) if s.migrations else None)
            note = retention.convert_at_start(conn, self.path)
        except BaseException:
            conn.close()
            raise
        if note is not None:
            self.notes.append(note)
        return conn

    def _release_lock(self) -> None:
        """Drop both locks; only once the database connection is closed (see take_lock)."""
        if self._file_lock is not None:
            with contextlib.suppress(OSError):
                os.close(self._file_lock)
            self._file_lock = None
        if self._lock_file is not None:
            with contextlib.suppress(OSError):
                self._lock_file.close()  # closing the file drops the flock
            self._lock_file = None

    def _take(self, messages: list[tuple[Any, ...]], inbox: Inbox) -> None:
        for message in messages:
            kind = message[0]
            if kind == "records":
                self._pending.append(Chunk(*message[1:]))
            elif kind == "recover":
                pid, version, config_path, now, first = message[1:]
                fn = functools.partial(
                    recover, pid=pid, version=version, config_path=config_path, now=now, seq=first
                )
                self._pending.append(Call(fn, self._recovered))
            elif kind == "replay_until":
                self._replay_until = message[1]
            elif kind == "stop":
                self._stopping = True
        if inbox.closed and not self._stopping:
            self._stopping = self._abandoned = True

    def _recovered(self, ok: bool, value: Any) -> None:
        self._send(("recovered", ok, value))

    def _loop(self, conn: sqlite3.Connection, inbox: Inbox) -> None:
        pending = self._pending
        backoff = self.settings.retry_initial
        while True:
            # What has arrived joins this batch, or is a reason not to prune now.
            self._take(inbox.take(), inbox)
            if self._prune_now(conn, waiting=bool(pending)):
                self._prune(conn, busy=bool(pending))
                continue
            if not pending:
                if self._stopping:
                    return
                self._idle(conn, inbox)
                continue
            head = pending[0]
            if isinstance(head, Call):
                pending.popleft()
                self._run_call(conn, head)
                continue
            items: list[Item] = []
            chunks = 0
            for chunk in pending:
                if not isinstance(chunk, Chunk) or len(items) >= MAX_BATCH:
                    break
                first, run_id, wires = chunk
                items += [(first + i, run_id, w) for i, w in enumerate(wires)]
                chunks += 1
            try:
                rejected = self._commit(conn, items)
            except sqlite3.Error as e:
                self.last_error = f"{type(e).__name__}: {e}"
                self.attempt_failures += 1
                self._send(("failure", self.last_error, self.attempt_failures, backoff))
                if self._abandoned:
                    return
                deadline = time.monotonic() + backoff
                while (left := deadline - time.monotonic()) > 0 and not self._abandoned:
                    self._take(inbox.wait(left), inbox)
                if self._abandoned:
                    return
                backoff = min(backoff * 2, self.settings.retry_max)
                continue
            for _ in range(chunks):
                pending.popleft()
            backoff = self.settings.retry_initial
            self._send(("batch", items[-1][0], rejected, self.commits))

    def _run_call(self, conn: sqlite3.Connection, call: Call) -> None:
        try:
            result = call.fn(conn)
        except BaseException as e:
            self._rollback(conn)
            call.done(False, f"{type(e).__name__}: {e}")
        else:
            self.commits += 1
            call.done(True, result)

    @staticmethod
    def _apply(conn: sqlite3.Connection, ops: tuple[Op, ...]) -> None:
        for sql, params, must_change in ops:
            cur = conn.execute(sql, params)
            if must_change and cur.rowcount != 1:
                raise Rejected(f"no open row to update ({sql.split()[1]} {params[-1]!r})")

    @staticmethod
    def _write(conn: sqlite3.Connection, batch: Plan) -> None:
        """Carry out a :class:`Plan`: multi-row INSERTs (powers of two up to 64 rows), then UPDATEs."""
        for sql, rows in batch.inserts:
            done, n = 0, len(rows)
            while done < n:
                k = min(MAX_ROWS_PER_INSERT, 1 << ((n - done).bit_length() - 1))
                conn.execute(_multi_row(sql, k), [v for row in rows[done : done + k] for v in row])
                done += k
        for sql, rows in batch.updates:
            for params in rows:
                if conn.execute(sql, params).rowcount != 1:
                    raise Rejected(f"no open row to update ({sql.split()[1]} {params[-1]!r})")

    def _commit(self, conn: sqlite3.Connection, items: list[Item]) -> list[tuple[int, str]]:
        """Write ``items`` in one transaction; returns the (seq, why) of the rejected ones."""
        if items and items[0][0] <= self._replay_until:
            items = [it for it in items if not self._written_already(conn, it)]
        try:
            batch = plan(items)
            conn.execute("BEGIN IMMEDIATE")
            self._write(conn, batch)
            crash_point("journal.before_commit")
            conn.execute("COMMIT")
            crash_point("journal.after_commit")
        except _REJECTABLE:
            self._rollback(conn)
            return self._commit_isolated(conn, items)
        except BaseException:
            self._rollback(conn)
            raise
        self.commits += 1
        return []

    def _commit_isolated(
        self, conn: sqlite3.Connection, items: list[Item]
    ) -> list[tuple[int, str]]:
        """Like :meth:`_commit`, record by record in order, each in a savepoint; drops the rejected."""
        rejected: list[tuple[int, str]] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            for item in items:
                conn.execute("SAVEPOINT record")
                try:
                    self._apply(conn, prepare(item))
                except _REJECTABLE as e:
                    conn.execute("ROLLBACK TO record")
                    rejected.append((item[0], f"{type(e).__name__}: {e}"))
                conn.execute("RELEASE record")
            crash_point("journal.before_commit")
            conn.execute("COMMIT")
            crash_point("journal.after_commit")
        except BaseException:
            self._rollback(conn)
            raise
        self.commits += 1
        return rejected

    def _written_already(self, conn: sqlite3.Connection, item: Item) -> bool:
        """A replayed measurement or KV peak that the dead writer process had written (see replay_until)."""
        seq, _, w = item
        sql = WRITTEN_ALREADY.get(w[0])
        if seq > self._replay_until or sql is None:
            return False
        return conn.execute(sql, (w[1], w[2])).fetchone() is not None

    def _prune_now(self, conn: sqlite3.Connection, *, waiting: bool) -> bool:
        """A slice is due and may run (with live records ``waiting``: only when pruning is behind)."""
        p = self.pruner
        return p is not None and not self._stopping and p.due(conn) and p.may_run(waiting)

    def _prune(self, conn: sqlite3.Connection, *, busy: bool) -> None:
        """One slice in a transaction of its own (``busy``: live records wait for it)."""
        assert self.pruner is not None
        for level, line in self.pruner.alone(conn, busy=busy):
            self._send(("note", level, line))

    def _idle(self, conn: sqlite3.Connection, inbox: Inbox) -> None:
        """Nothing to write or prune: wait for messages; after pruning, checkpoint once it is quiet."""
        pruner = self.pruner
        messages = inbox.wait(retention.QUIET_S if pruner and pruner.dirty else self._idle_wait)
        if pruner is not None and not messages:
            pruner.idle(conn)  # a checkpoint if it pruned since the last one
        self._take(messages, inbox)

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")


#: how long the journal file's own lock is awaited after the lock file was (see take_lock)
FILE_LOCK_GRACE_S = 1.0


def take_lock(path: Path, daemon_pid: int, wait: float) -> tuple[IO[str], int]:
    """Exclusive ``flock`` locks on ``<real path>.lock`` and on the journal file itself.

    The lock file is named after the resolved path, so a symlink or a relative
    path to the journal finds the same one; it holds the daemon's pid. It is
    refused at once while the daemon named in it lives; if that one is dead, its
    writer process is finishing, and the lock is awaited up to ``wait`` s. The
    second lock is on the journal file's own inode (created empty if missing),
    which every name of the file shares, hard links included. SQLite's POSIX
    locks do not mix with ``flock`` ones; the descriptor stays open until the
    database is closed (closing any descriptor of a file drops the POSIX locks
    the process holds on it).
    """
    real = path.resolve()
    lock = open(real.with_name(real.name + ".lock"), "a+")  # noqa: SIM115
    deadline = time.monotonic() + wait
    waited = False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            lock.seek(0)
            holder = lock.read().strip()
            if _alive(holder) or time.monotonic() > deadline:
                lock.close()
                raise JournalError(
                    f"journal: {path} is in use by another mlxd (pid {holder or 'unknown'})"
                ) from None
            waited = True
            time.sleep(0.02)
    try:
        fd = os.open(real, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        lock.close()
        raise
    # a dead daemon's writer we waited for drops this lock as it exits, just after the other
    file_deadline = time.monotonic() + (FILE_LOCK_GRACE_S if waited else 0.0)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            if time.monotonic() > file_deadline:
                os.close(fd)
                lock.close()
                raise JournalError(
                    f"journal: {path} is in use by another mlxd (under another name: a hard link)"
                ) from None
            time.sleep(0.02)
    lock.seek(0)
    lock.truncate()
    lock.write(str(daemon_pid))
    lock.flush()
    return lock, fd


def _alive(pid_text: str) -> bool:
    """True if ``pid_text`` names a live process (an unreadable pid counts as dead)."""
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


# ---- the process ----------------------------------------------------------------------------------


class _Reports:
    """Writes framed messages to the daemon; notes when the daemon is gone."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.broken = False

    def send(self, message: tuple[Any, ...]) -> None:
        if self.broken:
            return
        data = memoryview(frame(message))
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError:  # the daemon is gone
            self.broken = True


def main() -> None:
    """The writer process: one thread, reading the daemon's messages until ``stop`` or the end."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    reports = _Reports(os.dup(1))
    os.dup2(2, 1)  # a stray print must not corrupt the protocol
    inbox = Inbox(0)
    first: list[tuple[Any, ...]] = []
    while not first and not inbox.closed:
        first = inbox.wait(None)
    if not first or first[0][0] != "open":
        return
    settings: Settings = first[0][1]
    crash_points.also_kill(settings.daemon_pid)
    writer = Writer(settings, reports.send)
    writer._take(first[1:], inbox)
    writer.run(inbox)


def command() -> list[str]:
    """This interpreter running :func:`mlxd.journal.writer.main`, this ``mlxd`` importable."""
    return child_command("mlxd.journal.writer")


if __name__ == "__main__":
    main()
