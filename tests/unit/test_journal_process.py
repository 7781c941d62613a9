"""The journal's writer process: the wire format, the pipe protocol, its lifetime and urgency."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from mlxd.config import Measurement
from mlxd.errors import JournalError
from mlxd.journal import link
from mlxd.journal.journal import Journal
from mlxd.journal.rows import EndRun, decode, encode, event_json
from mlxd.journal.writer import Frames, frame, take_lock
from mlxd.residency.events import LeaseAcquired, LeaseReleased, MeasurementEvent, TransitionEvent
from mlxd.residency.states import Outcome, Reason, State
from tests.support.logs import logged

from .test_journal import running

EVENTS = [
    TransitionEvent("m", State.LOADING, State.LOADED, Reason.PRELOAD, 1.25, 7, None),
    TransitionEvent("ü", State.LOADED, State.UNLOADED, Reason.CRASH_RECOVERY, 2.0, None, 'x"y\n'),
    LeaseAcquired("L1", "m", "req-1", "/v1/chat/completions", 3.5),
    LeaseAcquired("L2", "m", None, None, 1e20),
    LeaseReleased("L1", "m", Outcome.PREEMPTED, 4.0, 1, 2, 0.125),
    LeaseReleased("L2", "m", Outcome.COMPLETED, 5.0),
    MeasurementEvent("m", 6.0, 123, 0.5),
    MeasurementEvent("m", 7.0, 456, 0.25, "5e1f0c2a"),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_wire_records_round_trip(event: object) -> None:
    """decode(encode(e)) == e for every event type, through a pickle as on the pipe."""
    wire = encode(event)  # type: ignore[arg-type]
    assert wire[0] == event.kind  # type: ignore[attr-defined]
    assert decode(pickle.loads(pickle.dumps(wire))) == event


def test_end_run_round_trips() -> None:
    assert decode(encode(EndRun(9.5, True))) == EndRun(9.5, True)


@pytest.mark.parametrize(
    "event", [e for e in EVENTS if not isinstance(e, MeasurementEvent)], ids=lambda e: type(e).__name__
)
def test_payload_json_is_json_dumps_of_as_dict(event: object) -> None:
    """The events row's payload is byte for byte json.dumps(as_dict()), compact."""
    expected = json.dumps(event.as_dict(), separators=(",", ":"))  # type: ignore[attr-defined]
    assert event_json(encode(event)) == expected  # type: ignore[arg-type]


@given(
    st.lists(
        st.tuples(st.text(max_size=20), st.integers(), st.floats(allow_nan=False), st.none()),
        max_size=8,
    ),
    st.lists(st.integers(min_value=1, max_value=50), max_size=20),
)
def test_frames_survive_any_cut_of_the_stream(
    messages: list[tuple[object, ...]], cuts: list[int]
) -> None:
    """Messages come out whole and in order however the pipe splits the bytes."""
    data = b"".join(frame(m) for m in messages)
    frames, out, start = Frames(), [], 0
    for size in [*cuts, len(data)]:
        out += frames.feed(data[start : start + size])
        start += size
    assert out == messages
    assert not frames.partial


async def test_a_writer_process_runs_and_shows_in_ps(tmp_path: Path) -> None:
    """run() starts one child process, which is gone after run() returns."""
    async with running(tmp_path / "j.db") as j:
        pid = j.writer_pid
        assert pid is not None and pid != os.getpid()
        os.kill(pid, 0)  # alive
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _ignored_signals(pid: int) -> set[signal.Signals] | None:
    """The signals process ``pid`` ignores, from /proc (None where there is no /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return {s for s in signal.Signals if mask >> (s.value - 1) & 1}


async def test_the_writer_ignores_sigterm_and_sigint(tmp_path: Path) -> None:
    """A signal to the whole process group does not kill the writer before the daemon's last rows."""
    async with running(tmp_path / "j.db") as j:
        assert j.writer_pid is not None
        # An ignored signal is discarded when it is sent, so there is nothing to wait for
        # once the kernel says the writer ignores both (SigIgn in /proc, Linux).
        ignored = _ignored_signals(j.writer_pid)
        assert ignored is None or {signal.SIGTERM, signal.SIGINT, signal.SIGHUP} <= ignored
        os.kill(j.writer_pid, signal.SIGTERM)
        os.kill(j.writer_pid, signal.SIGINT)
        seq = j.record(LeaseAcquired("L", "m", None, None, 1.0))
        await j.wait_committed(seq)
        assert j.leases()[0]["id"] == "L"


async def _committed_after_restart(j: Journal, seq: int) -> None:
    """Wait for ``seq`` while the writer is being replaced: each failed attempt raises
    ``cannot write`` once (wait_committed itself sleeps until the journal's next report)."""
    with trio.fail_after(20):
        while True:
            try:
                await j.wait_committed(seq)
                return
            except JournalError as e:
                if "cannot write" not in str(e):
                    raise


async def test_a_killed_writer_is_replaced_without_losing_a_record(tmp_path: Path) -> None:
    """If the writer process is killed, waiters get JournalError at once, a new writer is started, and every record, sent before or after the kill, is written once and in order."""
    async with running(tmp_path / "j.db", flush_interval=0) as j:
        await j.wait_committed(j.record(LeaseAcquired("A", "m", None, None, 1.0)))
        measured = j.record(MeasurementEvent("m", 1.5, 100, 0.1))
        await j.wait_committed(measured)
        pid = j.writer_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        seq = j.record(LeaseAcquired("L", "m", None, None, 2.0))
        with pytest.raises(JournalError):
            await j.wait_committed(seq)
        assert not j.healthy and "writer process stopped" in (j.last_error or "")
        await _committed_after_restart(j, seq)
        assert j.healthy and j.restarts == 1 and j.writer_pid not in (None, pid)
        await j.wait_committed(j.record(LeaseReleased("L", "m", Outcome.COMPLETED, 3.0)))
        assert [(r["id"], r["outcome"]) for r in j.leases()] == [("A", None), ("L", "completed")]
        assert j.latest_measurements() == {"m": Measurement(100)}
    with pytest.raises(JournalError, match="closed"):
        j.record(LeaseAcquired("L2", "m", None, None, 1.0))


def test_a_replayed_measurement_is_not_written_twice(tmp_path: Path) -> None:
    """Records a dead writer committed but never confirmed come again after ``replay_until``; a measurement among them is not inserted twice (the others are resent only above the file's highest seq)."""
    import sqlite3

    from mlxd.journal.writer import Settings, Writer

    settings = Settings(str(tmp_path / "j.db"), "normal", 1000, 0.01, 0.1, None, os.getpid())
    sent: list[tuple[object, ...]] = []
    writer = Writer(settings, sent.append)
    conn = writer._open()
    run_id = conn.execute(
        "INSERT INTO runs(started_at, pid, version) VALUES (1, 1, 't')"
    ).lastrowid
    conn.commit()
    measure = encode(MeasurementEvent("m", 1.5, 100, 0.1))
    acquired = encode(LeaseAcquired("A", "m", None, None, 1.0))
    writer._commit(conn, [(1, run_id, measure), (2, run_id, acquired)])
    writer._take([("replay_until", 3)], type("Inbox", (), {"closed": False})())  # type: ignore[arg-type]
    later = encode(MeasurementEvent("m", 2.5, 200, 0.1))
    writer._commit(conn, [(1, run_id, measure), (3, run_id, later)])
    assert conn.execute("SELECT at FROM measurements ORDER BY at").fetchall() == [(1.5,), (2.5,)]
    conn.close()
    writer._release_lock()
    with sqlite3.connect(tmp_path / "j.db") as c:
        assert c.execute("SELECT count(*) FROM leases").fetchone() == (1,)


async def test_a_stopped_writer_degrades_then_is_replaced(tmp_path: Path) -> None:
    """A writer that stops answering (SIGSTOP) makes the journal unhealthy after stall_s, is killed after kill_s and replaced; its records are written."""
    async with running(tmp_path / "j.db", flush_interval=0, stall_s=0.3, kill_s=1.5) as j:
        pid = j.writer_pid
        assert pid is not None
        with logged("mlxd.journal", "has not answered", logging.WARNING) as stalled:
            os.kill(pid, signal.SIGSTOP)
            t0 = trio.current_time()
            seq = j.record(LeaseAcquired("L", "m", None, None, 1.0))
            with trio.fail_after(5):
                await stalled.wait()  # the watchdog's warning, stall_s after the record went
        assert trio.current_time() - t0 >= 0.3
        assert not j.healthy and "has not answered" in (j.last_error or "")
        await _committed_after_restart(j, seq)
        assert trio.current_time() - t0 >= 1.5
        assert j.restarts == 1 and j.writer_pid != pid
        assert [r["id"] for r in j.leases()] == ["L"]


async def test_a_write_the_writer_does_not_read_is_cut_at_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shielded write into a writer that stopped reading (SIGSTOP, no watchdog) ends at
    SEND_LIMIT_S: the writer is killed and replaced, and every record is written once."""
    monkeypatch.setattr(link, "SEND_LIMIT_S", 1.0)
    N = 60_000
    async with running(tmp_path / "j.db", flush_interval=0) as j:
        pid = j.writer_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        t0 = trio.current_time()
        # one message (about 1.6 MB) larger than the pipe's buffer (writer.PIPE_BYTES): it blocks
        seqs = [j.record(LeaseAcquired(f"L{i}", "m", None, None, float(i))) for i in range(N)]
        await _committed_after_restart(j, seqs[-1])
        assert trio.current_time() - t0 >= 1.0
        assert j.restarts == 1 and j.writer_pid != pid
        assert len(j.leases(limit=None)) == N


async def test_an_awaited_record_is_sent_at_once(tmp_path: Path) -> None:
    """Within the flush interval, records nobody awaits are held back; wait_committed sends them."""
    async with running(tmp_path / "j.db", flush_interval=30.0) as j:
        await j.wait_committed(j.record(LeaseAcquired("A", "m", None, None, 1.0)))
        held = j.record(LeaseAcquired("B", "m", None, None, 2.0))
        await trio.testing.wait_all_tasks_blocked()  # the flusher had every chance to send B
        assert j.sent_seq < held  # the interval (30 s) runs from A's message
        t0 = time.monotonic()
        awaited = j.record(LeaseAcquired("C", "m", None, None, 3.0))
        await j.wait_committed(awaited)
        assert time.monotonic() - t0 < 5.0
        assert [row["id"] for row in j.leases()] == ["A", "B", "C"]


async def test_records_nobody_awaits_are_written_after_the_interval(tmp_path: Path) -> None:
    """Without a waiter, a record held back reaches the file one flush interval later."""
    async with running(tmp_path / "j.db", flush_interval=0.5) as j:
        await j.wait_committed(j.record(LeaseAcquired("A", "m", None, None, 1.0)))
        with j.subscribe() as sub:
            t0 = trio.current_time()
            held = j.record(LeaseAcquired("B", "m", None, None, 2.0))
            with trio.fail_after(5):
                async for seq, payload in sub:
                    if seq == held:
                        assert payload["lease_id"] == "B"
                        break
            assert trio.current_time() - t0 >= 0.3
        assert [row["id"] for row in j.leases()] == ["A", "B"]


async def test_a_short_leases_records_after_a_quiet_spell_travel_together(tmp_path: Path) -> None:
    """The first record after a quiet spell waits one interval, so the lease's end joins it:
    one message and one commit for both, not one each (the per-request cost on a 2-core host)."""
    async with running(tmp_path / "j.db", flush_interval=0.5) as j:
        await j.wait_committed(j.record(LeaseAcquired("A", "m", None, None, 1.0)))
        # the subject, not an ordering: quiet for longer than the interval, so that B finds
        # the flusher parked with its last message long gone
        await trio.sleep(0.6)
        before = j.commit_count
        with j.subscribe() as sub:
            j.record(LeaseAcquired("B", "m", None, None, 2.0))
            await trio.testing.wait_all_tasks_blocked()  # the flusher had every chance to send B
            assert j.sent_seq < j.last_seq  # not sent alone
            last = j.record(LeaseReleased("B", "m", Outcome.COMPLETED, 2.1))
            with trio.fail_after(5):  # nobody awaits them: they go when the interval ends
                async for seq, _payload in sub:
                    if seq == last:
                        break
        assert j.commit_count - before == 1
        assert [(r["id"], r["outcome"]) for r in j.leases()] == [("A", None), ("B", "completed")]


_HOLDER = """
import fcntl, sys, time
lock = open(sys.argv[1], "a+")
fcntl.flock(lock, fcntl.LOCK_EX)
lock.seek(0); lock.truncate(); lock.write(sys.argv[2]); lock.flush()
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _holding(lock: Path, pid: int, seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(lock), str(pid), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_the_lock_of_a_dead_daemons_writer_is_awaited(tmp_path: Path) -> None:
    """A writer still finishing for a daemon that died delays the next start; it does not fail it."""
    path = tmp_path / "j.db"
    holder = _holding(path.with_name("j.db.lock"), _dead_pid(), 0.5)
    t0 = time.monotonic()
    lock, fd = take_lock(path, os.getpid(), wait=10.0)
    waited = time.monotonic() - t0
    lock.close()
    os.close(fd)
    holder.wait()
    assert 0.2 < waited < 5.0


def test_the_lock_of_a_live_daemon_is_refused_at_once(tmp_path: Path) -> None:
    """While the daemon named in the lock file lives, a second one is refused without waiting."""
    path = tmp_path / "j.db"
    holder = _holding(path.with_name("j.db.lock"), os.getpid(), 30.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(JournalError, match=rf"in use by another mlxd \(pid {os.getpid()}\)"):
            take_lock(path, os.getpid(), wait=10.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        holder.kill()
        holder.wait()
