"""The SQLite journal: a writer process, group commit, a commit watermark, crash recovery.

Theory of operation
-------------------
The daemon owns one :class:`Journal` and starts it with
``await nursery.start(journal.run)``. ``run()`` starts ONE writer process
(:mod:`mlxd.journal.writer`), which opens the file (WAL, ``synchronous`` FULL
or NORMAL, foreign keys, ``busy_timeout``), applies the migrations, reads the
highest sequence number and reports ready; only then does ``run()`` call
``task_status.started()``. The process owns the only writing connection.
Why a process: see :mod:`mlxd.journal.writer` (one GIL per process).

Then, once, the daemon calls ``await`` :meth:`Journal.begin_run`: it inserts
this run's ``runs`` row and repairs what the previous run left behind, in one
transaction with that row (see :class:`RecoveryReport`), before any record.

From Trio, :meth:`Journal.record` never blocks and does almost nothing: it
turns the event into a plain tuple (:func:`mlxd.journal.rows.encode`),
assigns the next journal sequence number and appends it to a list. A flusher
task pickles the list and sends it down the pipe in one message, at most every
``flush_interval`` (10 ms), at once when somebody awaits one (see
``_flush_loop``). The writer process writes everything that
has arrived in one transaction, so a burst of N records costs one commit.
After each commit it reports the last seq written, and a reader task moves the
*watermark* (every seq up to it is on disk), wakes
:meth:`Journal.wait_committed` callers and delivers the committed events to
subscribers (from the tuples kept until then).

Sequence numbers: one counter here, initialised from the file's highest seq.
Every record and :meth:`end_run` takes the next number; a transition's
``transitions.seq`` equals its ``events.seq``; measurements, KV peaks and the end
of a run take a number but have no ``events`` row, so ids are increasing, not dense.

When a write fails (disk full, I/O error, the file locked past
``busy_timeout``...), the transaction rolls back, the rows stay queued in order,
:attr:`Journal.healthy` turns false with :attr:`Journal.last_error`, and the
writer retries with exponential backoff; the first successful commit writes
them all and turns ``healthy`` true again. A row the database rejects for what
it is (a constraint: duplicate lease id, unknown lease, bad vocabulary) cannot
succeed on retry: it alone is left out, the rest of its batch commits, and
``wait_committed`` on its seq raises :class:`~mlxd.errors.JournalError`.

The writer process is supervised. If it dies (killed, crashed) once the run
has begun, ``healthy`` turns false, waiters get ``JournalError`` (their rows
stay queued), and a new writer is started (after a backoff if it fails to
open: read-only file system, full disk...). The new writer reports the
file's highest sequence number; every record above it (and above the
watermark) that the old one had not confirmed is sent again, in order, ahead
of what arrived meanwhile, so no row is lost, doubled or reordered (a
measurement or a KV peak, the rows without a sequence number of their own, is
inserted again only if it is not there). A writer that stops answering (stopped with
SIGSTOP, hung) turns ``healthy`` false after ``stall_s`` and is killed and
replaced after ``kill_s`` (the daemon turns this watchdog on; it runs on real
time). Records never wait: ``record`` keeps queueing them while no writer runs. A writer that dies before the run has begun (while it
opens or recovers) is fatal: ``run()`` raises.

Retention (``retain_days``, ``max_mb``; none by default here, the daemon
passes the config's): the writer process prunes the oldest rows in short
slices of their own between batches, ahead of waiting records only when it
has fallen behind (:mod:`mlxd.journal.retention`).

Readers (:meth:`history`, :meth:`leases`, :meth:`events_after`,
:meth:`latest_measurements`) open their own read-only connection per call.

Live events: :meth:`subscribe` returns a :class:`Subscription` with a bounded
buffer, fed only after commit. A subscriber that falls behind is dropped
(``dropped`` set, iteration ends after its buffered events) rather than
slowing anyone down. The SSE recipe without loss: subscribe first, send
``backlog(last_event_id)`` (a ``gap`` event first if retention pruned events
after it), then the subscription's events whose seq is
higher than the last one sent; when it ends with ``dropped``, repeat.

Shutdown: the daemon calls :meth:`end_run` (clean or not) and cancels
``run()``, which sends what is left, asks the writer to stop, and waits for it
at most ``flush_timeout`` seconds (shielded, bounded); after that the writer
is killed, and rows still unwritten are reported in the log and lost, like any
write after a crash.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from mlxd.errors import JournalError
from mlxd.journal.link import WriterLink
from mlxd.journal.migrate import Synchronous
from mlxd.journal.reads import JournalFile
from mlxd.journal.rows import ENCODERS, RESIDENT, EndRun, RecoveryReport, Wire
from mlxd.journal.subscription import PUBLISHED_FIELDS, Subscribers, Subscription
from mlxd.journal.writer import Settings
from mlxd.residency.events import ManagerEvent
from mlxd.units import MIB

__all__ = ["RESIDENT", "Journal", "RecoveryReport", "Subscription"]

log = logging.getLogger("mlxd.journal.journal")


#: seconds between two messages to the writer while records keep coming (see ``_flush_loop``)
FLUSH_INTERVAL = 0.01
#: a batch this big is sent without waiting for the interval
FLUSH_RECORDS = 2000
#: a writer that died is replaced after this long, doubling while new ones fail to open
RESTART_FIRST_S = 0.1
RESTART_MAX_S = 5.0


class Journal(JournalFile):
    """The daemon's journal. Construct, ``await nursery.start(journal.run)``, then ``begin_run``."""

    def __init__(
        self,
        path: Path | str,
        *,
        synchronous: Synchronous = "full",
        wall_clock: Callable[[], float] = time.time,
        busy_timeout_ms: int = 5000,
        flush_timeout: float = 10.0,
        flush_interval: float = FLUSH_INTERVAL,
        retry_initial: float = 0.05,
        retry_max: float = 5.0,
        stall_s: float | None = None,
        kill_s: float = 10.0,
        subscriber_buffer: int = 1024,
        migrations: Path | None = None,
        retain_days: float = 0.0,
        max_mb: float = 0.0,
    ) -> None:
        super().__init__(path, busy_timeout_ms=busy_timeout_ms)
        self.synchronous: Synchronous = synchronous
        self._wall_clock = wall_clock
        self._flush_timeout = flush_timeout
        self._subscriber_buffer = subscriber_buffer
        self._settings = Settings(
            path=str(self.path),
            synchronous=synchronous,
            busy_timeout_ms=busy_timeout_ms,
            retry_initial=retry_initial,
            retry_max=retry_max,
            migrations=str(migrations) if migrations is not None else None,
            daemon_pid=os.getpid(),
            retain_days=retain_days,
            max_bytes=int(max_mb * MIB),
        )
        self._stall_s = stall_s
        self._kill_s = kill_s
        #: the current writer process (a new link after a restart)
        self._link: WriterLink | None = None
        #: when a message went to the writer while nothing was in flight (stall watchdog)
        self._sent_at = 0.0
        self._restarts = 0
        #: commits of the writer processes before the current one
        self._commit_base = 0
        #: the last seq handed out; invariant: _committed <= _sent <= _last_seq
        self._last_seq = 0
        #: the last seq sent to the writer process
        self._sent = 0
        #: the watermark: every seq <= it is committed (or was rejected)
        self._committed = 0
        #: records not yet sent (seqs _sent + 1 .. _last_seq)
        self._pending: list[Wire] = []
        #: records sent but not yet committed, as (first seq, records) per message
        self._inflight: deque[tuple[int, list[Wire]]] = deque()
        self._flush_interval = flush_interval
        self._flusher_parked = False
        self._flush_wanted = trio.Event()
        #: somebody awaits a record not yet sent: send without waiting for flush_interval
        self._urgent = False
        self._rejected: dict[int, str] = {}
        self._progress = trio.Event()
        self._recovering = False
        self._recovered: tuple[bool, Any] | None = None
        self._started = False
        #: True from begin_run until end_run or shutdown: record()'s one check
        self._accepting = False
        self._running = False
        self._closed = False
        self._run_id: int | None = None
        self._run_ended = False
        self._subscribers = Subscribers()
        #: called (synchronously) each time ``healthy`` or, while unhealthy, ``last_error`` changes
        self._health_listeners: list[Callable[[], None]] = []
        self._healthy = True
        self._last_error: str | None = None
        self._attempt_failures = 0
        self._commits = 0

    # ---- state --------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """False while writes fail (rows are kept and retried); true again after a commit."""
        return self._healthy

    @property
    def rejected(self) -> dict[int, str]:
        """Rows the database refused for good this run (seq -> why); they are not in the file."""
        return self._rejected

    @property
    def last_error(self) -> str | None:
        """The last write failure (kept after recovery, for the record)."""
        return self._last_error

    @property
    def commit_count(self) -> int:
        """Transactions committed by the writer (group commit keeps it far below the records):
        ``mlxd_journal_commits_total`` in ``/metrics``; ``bench/journal.py`` reports records per
        commit from it."""
        return self._commits

    @property
    def run_id(self) -> int | None:
        return self._run_id

    @property
    def last_seq(self) -> int:
        """The last sequence number handed out."""
        return self._last_seq

    @property
    def sent_seq(self) -> int:
        """The last sequence number sent to the writer process (``committed_seq <= sent_seq <= last_seq``)."""
        return self._sent

    @property
    def committed_seq(self) -> int:
        """The watermark: every sequence number up to it is written (or was rejected)."""
        return self._committed

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid while it runs."""
        return self._link.pid if self._link is not None else None

    @property
    def restarts(self) -> int:
        """How many times a writer process that died or hung was replaced."""
        return self._restarts

    def on_health(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` synchronously each time :attr:`healthy` turns, or the error it
        reports changes: the daemon's load gate follows it without polling."""
        self._health_listeners.append(callback)

    def _set_health(self, healthy: bool, error: str | None = None) -> None:
        before = (self._healthy, self._last_error)
        self._healthy = healthy
        self._last_error = error if error is not None else self._last_error
        if before != (healthy, self._last_error):
            for callback in self._health_listeners:
                try:
                    callback()
                except Exception:  # a listener must never break the journal's reports
                    log.exception("journal health listener %r failed", callback)

    # ---- lifecycle ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the writer process (it opens and migrates) and keep one running; on
        cancellation flush and stop it (see the module docstring)."""
        if self._started:
            raise RuntimeError("Journal.run() may be called only once")
        self._started = True
        backoff = RESTART_FIRST_S
        try:
            while True:
                first = not self._running
                self._link = link = await WriterLink.start(
                    self._settings, None if first else self._last_seq
                )
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(link.read, self._dispatch)
                    await link.ready.wait()
                    if link.open_error is None and not link.exited.is_set():
                        backoff = RESTART_FIRST_S
                        if first:
                            self._last_seq = self._sent = self._committed = link.ready_seq
                            self._running = True
                            task_status.started()
                        else:
                            self._resume(link.ready_seq)
                        nursery.start_soon(self._flush_loop, link)
                        if self._stall_s is not None:
                            nursery.start_soon(self._watchdog, link, self._stall_s)
                        try:
                            await link.exited.wait()
                        finally:  # a message being written gets flush_timeout to finish, no more
                            if link.send_scope is not None:
                                link.send_scope.deadline = min(
                                    link.send_scope.deadline, trio.current_time() + self._flush_timeout
                                )
                    nursery.cancel_scope.cancel()
                if first and link.open_error is not None:
                    raise link.open_error
                if self._run_id is None:  # nothing begun, nothing to resume
                    raise JournalError(f"journal: the writer process stopped: {link.exit_error}")
                self._writer_lost(link)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, RESTART_MAX_S)
        finally:
            self._running = False
            await self._shutdown()

    def _writer_lost(self, link: WriterLink) -> None:
        """The writer process died or hung after the run began: keep the rows, wake waiters."""
        why = link.open_error or link.exit_error
        self._set_health(False, f"the journal writer process stopped ({why}); restarting it")
        self._attempt_failures += 1
        self._commit_base = self._commits
        log.error("journal: %s", self._last_error)
        self._wake()

    def _resume(self, file_seq: int) -> None:
        """A new writer is ready: send again, in order, every record the file does not have."""
        start = max(file_seq, self._committed)
        records = [(first + i, w) for first, batch in self._inflight for i, w in enumerate(batch)]
        records += [(self._sent + 1 + i, w) for i, w in enumerate(self._pending)]
        self._inflight.clear()
        self._subscribers.publish(
            [(seq, w) for seq, w in records if self._committed < seq <= start
             and w[0] in PUBLISHED_FIELDS and seq not in self._rejected]
        )
        self._committed = self._sent = start
        self._pending = [w for seq, w in records if seq > start]
        self._restarts += 1
        log.warning("journal: writer process restarted (%d records to write again)",
                    len(self._pending))
        if not self._pending:
            self._set_health(True)
        self._flusher_parked = False
        self._flush_wanted.set()
        self._wake()

    async def _watchdog(self, link: WriterLink, stall_s: float) -> None:
        """A writer that does not answer for ``stall_s`` makes the journal unhealthy; at
        ``kill_s`` it is killed (and ``run`` replaces it). Real time only: its timer would
        make a virtual clock jump while the writer works (so it is off unless asked for)."""
        while True:
            await trio.sleep(min(stall_s, 1.0))
            if not self._inflight:
                continue
            silent = trio.current_time() - max(link.last_report, self._sent_at)
            if silent >= self._kill_s:
                log.error("journal: the writer process has not answered for %.0f s; killing it",
                          silent)
                link.exit_error = f"it did not answer for {silent:.0f} s"
                link.kill()
                return
            if silent >= stall_s and self._healthy:
                self._set_health(False, f"the journal writer process has not answered for {silent:.0f} s")
                log.warning("journal: %s", self._last_error)
                self._wake()

    async def _shutdown(self) -> None:
        self._accepting = False
        link = self._link
        last: list[tuple[Any, ...]] = []
        if link is not None and self._pending and self._run_id is not None and link.ready.is_set():
            last = [self._take_pending()]
        exited = link is None or await link.close(last, self._flush_timeout, self._dispatch)
        if not exited and self._last_seq > self._committed:
            log.error(
                "journal: gave up flushing after %.1fs; %d records not written (%s)",
                self._flush_timeout, self._last_seq - self._committed, self._last_error,
            )
        self._closed = True
        self._subscribers.close_all()
        self._wake()

    async def begin_run(self, pid: int, version: str, config_path: str | None) -> RecoveryReport:
        """Insert this run's row and repair the previous run; call once after ``run()`` started.

        Raises :class:`JournalError` if the file cannot be written.
        """
        if not self._running:
            raise RuntimeError("begin_run() needs the journal running (await nursery.start(run))")
        if self._run_id is not None or self._recovering:
            raise RuntimeError("begin_run() may be called only once")
        self._recovering = True
        first = self._last_seq + 1
        link = self._link
        assert link is not None
        with contextlib.suppress(trio.BrokenResourceError):  # the writer died: see below
            await link.send(("recover", pid, version, config_path, self._wall_clock(), first))
        while self._recovered is None and not link.exited.is_set():
            await self._progress.wait()
        if self._recovered is None:
            why = f"the writer process stopped: {link.exit_error}"
            raise JournalError(f"journal: cannot start a run in {self.path}: {why}")
        ok, value = self._recovered
        if not ok:
            raise JournalError(f"journal: cannot start a run in {self.path}: {value}")
        report: RecoveryReport = value[0]
        rows: list[tuple[int, tuple[Any, ...]]] = value[1]
        self._run_id = report.run_id
        self._accepting = True
        if rows:
            self._last_seq = self._sent = rows[-1][0]
        self._committed = self._last_seq
        self._subscribers.publish(rows)
        return report

    def end_run(self, clean: bool) -> int:
        """Stamp this run's ``stopped_at`` and ``clean_stop``; queued after every record."""
        seq = self.record(EndRun(self._wall_clock(), clean))  # type: ignore[arg-type]
        self._accepting = False
        self._run_ended = True
        return seq

    # ---- writing from Trio ----------------------------------------------------------------

    def record(self, event: ManagerEvent) -> int:
        """Queue ``event`` for the journal without blocking; returns its sequence number.

        Here the event only becomes its wire record (while it is still in the
        CPU's cache) and takes the next sequence number; the flusher task
        sends it to the writer process. Raises :class:`JournalError` once the
        journal is closed or the run ended. The manager calls this for every
        lease: it is kept to a few attribute operations.
        """
        if not self._accepting:
            self._check_recording()
        try:
            wire = ENCODERS[type(event)](event)
        except KeyError:
            raise TypeError(f"not a journal event: {event!r}") from None
        self._pending.append(wire)
        self._last_seq = seq = self._last_seq + 1
        if self._flusher_parked:
            self._flusher_parked = False
            self._flush_wanted.set()
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
        if target > self._sent:  # somebody waits: the flusher need not wait for more records
            self._urgent = True
            self._flush_wanted.set()
        failures = self._attempt_failures
        while self._committed < target:
            if self._closed:
                raise JournalError(f"journal: closed before seq {target} was written")
            if self._attempt_failures != failures:
                raise JournalError(f"journal: cannot write: {self._last_error}")
            await self._progress.wait()
        if (why := self._rejected.get(target)) is not None:
            raise JournalError(f"journal: seq {target} was not written: {why}")

    def _check_recording(self) -> None:
        """Raise why records are not accepted now (``record``'s slow path)."""
        if self._closed or (self._run_id is not None and not self._running):
            raise JournalError("journal: closed")
        if self._run_id is None:
            raise RuntimeError("record() needs begin_run() first")
        if self._run_ended:
            raise JournalError("journal: this run has ended (end_run was called)")

    # ---- the pipes ----------------------------------------------------------------------

    async def _flush_loop(self, link: WriterLink) -> None:
        """Send what ``record`` queued to the writer, in as few messages as latency allows.

        Every message is a pipe write that wakes the writer on another core and
        an answer that wakes this loop: tens of microseconds of the event loop's
        time each on a virtual machine, which at thousands of records a second
        would be most of the journal's cost. So a message goes when

        * the writer has answered the one before (it would have put everything
          sent meanwhile into its next transaction anyway), and
        * ``flush_interval`` has passed since the last one and since the
          first record of a quiet spell arrived, unless somebody awaits a
          record (:meth:`wait_committed` sends at once) or the batch is
          already big.

        Waiting after a quiet spell too means that a short request's lease
        records (its start and its end, a few milliseconds apart) travel in one
        message instead of two: on a 2-core virtual machine the pipe write and
        the answer cost the event loop about 0.3 ms each per one-token request.
        Nobody waits for those records meanwhile; a record somebody awaits (a
        transition acknowledged to a client) goes at once. A saturated loop
        sends at most 1/``flush_interval`` messages a second.
        """
        due = -math.inf  # when the next message may go, unless it is urgent
        try:
            while True:
                if not self._pending:
                    self._flush_wanted = trio.Event()
                    self._flusher_parked = True
                    await self._flush_wanted.wait()
                    due = max(due, trio.current_time() + self._flush_interval)
                while self._inflight and not link.exited.is_set():
                    await self._progress.wait()
                delay = due - trio.current_time()
                if delay > 0 and not self._urgent and len(self._pending) < FLUSH_RECORDS:
                    self._flush_wanted = trio.Event()
                    with trio.move_on_after(delay):
                        await self._flush_wanted.wait()
                self._urgent = False
                due = trio.current_time() + self._flush_interval
                await link.send(self._take_pending())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the writer is gone: the reader reports it

    def _take_pending(self) -> tuple[Any, ...]:
        """The ``records`` message of everything queued; it is in flight from now on."""
        batch, self._pending = self._pending, []
        first = self._sent + 1
        self._sent += len(batch)
        if not self._inflight:
            self._sent_at = trio.current_time()
        self._inflight.append((first, batch))
        assert self._run_id is not None
        return ("records", first, self._run_id, batch)

    # ---- the writer's reports -------------------------------------------------------------

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "batch":
            _, last, rejected, commits = message
            self._on_batch(last, rejected, commits)
        elif kind == "failure":
            _, error, failures, backoff = message
            self._set_health(False, error)
            self._attempt_failures = failures
            log.warning("journal: write failed (%s); retrying in %.2fs", error, backoff)
            self._wake()
        elif kind == "recovered":
            self._recovered = (message[1], message[2])
            self._commits += 1
            self._wake()
        elif kind == "note":
            log.log(message[1], "%s", message[2])
        else:
            raise JournalError(f"journal: unknown report from the writer process: {message!r}")

    def _wake(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    def _on_batch(self, last: int, rejected: list[tuple[int, str]], commits: int) -> None:
        if not self._healthy:
            log.warning("journal: writing again after: %s", self._last_error)
            self._set_health(True)
        self._commits = self._commit_base + commits
        self._committed = max(self._committed, last)
        for seq, why in rejected:
            self._rejected[seq] = why
            log.error("journal: seq %d rejected: %s", seq, why)
        inflight = self._inflight
        published: list[tuple[int, Any]] = []
        listening = bool(self._subscribers)
        while inflight and inflight[0][0] <= last:
            first, records = inflight[0]
            n = last - first + 1
            if n < len(records):
                inflight[0] = (last + 1, records[n:])
                records = records[:n]
            else:
                inflight.popleft()
            if listening:
                published += [
                    (first + i, r)
                    for i, r in enumerate(records)
                    if r[0] in PUBLISHED_FIELDS and first + i not in self._rejected
                ]
        self._subscribers.publish(published)
        self._wake()

    def subscribe(self, buffer: int | None = None) -> Subscription:
        """Live committed events; see :class:`Subscription` and the module doc for resuming."""
        if self._closed:
            raise JournalError("journal: closed")
        return self._subscribers.add(buffer or self._subscriber_buffer)
