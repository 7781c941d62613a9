"""Journal records on the wire and as SQL: what the writer process writes, and start-up recovery.

Theory of operation
-------------------
The daemon's event loop hands each journal event to the writer process
(:mod:`mlxd.journal.writer`) as a *wire record*: a plain tuple, the event's
``kind`` followed by its dataclass fields in order (``encode``: one C-level
``attrgetter`` per type). Plain tuples pickle an order of magnitude faster than
the dataclasses (the enum members and repeated strings in them are pickled
once per message and referenced after), and getting and pickling them is the
only per-record work left on the event loop. :func:`decode` turns a wire
record back into the event.

Everything else runs in the writer process, off the event loop: the rows of
each table, the JSON payload of the ``events`` row (exactly what
``json.dumps(event.as_dict())`` gives, compact), and the plan that writes a
whole batch in a few multi-row statements (:func:`plan`), with
:func:`prepare` as the record-by-record reference used when the database
rejects something in a batch. :func:`recover` is start-up recovery: the new
``runs`` row and the repair of what the previous run left open, in one
transaction.

Nothing here imports Trio: the writer process starts in tens of milliseconds.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable
from dataclasses import dataclass, fields
from json.encoder import (  # type: ignore[attr-defined]
    c_make_encoder,
    encode_basestring_ascii,
)
from typing import Any, NamedTuple

from mlxd.crash_points import crash_point
from mlxd.journal import responses
from mlxd.journal.responses import ResponseDeleted, ResponseStored
from mlxd.residency.events import (
    KvPeakEvent,
    LeaseAcquired,
    LeaseReleased,
    ManagerEvent,
    MeasurementEvent,
    TransitionEvent,
)
from mlxd.residency.states import HOLDS_MEMORY, SERVING, Outcome, Reason, State

#: States that count as "resident" for restore_on_start.
RESIDENT: frozenset[State] = SERVING

INSERT_EVENT = "INSERT INTO events(seq, run_id, at, kind, model, payload) VALUES (?, ?, ?, ?, ?, ?)"
INSERT_TRANSITION = (
    "INSERT INTO transitions(seq, run_id, at, model, from_state, to_state, reason, memory_bytes,"
    " error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
INSERT_LEASE = (
    "INSERT INTO leases(id, run_id, model, request_id, route, acquired_at, released_at, outcome,"
    " prompt_tokens, completion_tokens, client, kv_wait_seconds)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
RELEASE_LEASE = (
    "UPDATE leases SET released_at = ?, outcome = ?, prompt_tokens = ?, completion_tokens = ?,"
    " kv_wait_seconds = ? WHERE id = ? AND released_at IS NULL"
)
INSERT_MEASUREMENT = (
    "INSERT INTO measurements(model, at, memory_bytes, load_seconds) VALUES (?, ?, ?, ?)"
)
INSERT_MEASUREMENT_WEIGHTS = "INSERT INTO measurement_weights(model, at, weights) VALUES (?, ?, ?)"
INSERT_KV_PEAK = (
    "INSERT INTO kv_peaks(model, at, run_id, loaded_at, kv_peak_bytes, kv_budget_bytes,"
    " prompt_cache_bytes, prompt_cache_budget_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
END_RUN = "UPDATE runs SET stopped_at = ?, clean_stop = ? WHERE id = ?"


@dataclass(frozen=True, slots=True)
class EndRun:
    """The record :meth:`mlxd.journal.journal.Journal.end_run` queues: stamp the run's end."""

    at: float
    clean: bool

    kind = "end_run"


# ---- the wire format ----------------------------------------------------------------------------

#: wire record kinds: the events' own ``kind``
TRANSITION = TransitionEvent.kind
ACQUIRED = LeaseAcquired.kind
RELEASED = LeaseReleased.kind
MEASUREMENT = MeasurementEvent.kind
KV_PEAK = KvPeakEvent.kind
END = EndRun.kind
STORED = responses.STORED
DELETED = responses.DELETED

#: the rows without an ``events`` row (no seq in the file): how to tell that one is written
#: already, by its ``(model, at)`` (a record replayed after a writer died, see the writer)
WRITTEN_ALREADY: dict[str, str] = {
    MEASUREMENT: "SELECT 1 FROM measurements WHERE model = ? AND at = ? LIMIT 1",
    KV_PEAK: "SELECT 1 FROM kv_peaks WHERE model = ? AND at = ? LIMIT 1",
    STORED: responses.STORED_ALREADY,  # by (id, created_at)
}

#: a wire record: (kind, *fields); enum fields stay enum members (pickle memoizes them)
Wire = tuple[Any, ...]

#: per record type: one C-level getter of its kind and all its fields, in order
ENCODERS: dict[type, Callable[[Any], Wire]] = {
    cls: operator.attrgetter("kind", *(f.name for f in fields(cls)))
    for cls in (TransitionEvent, LeaseAcquired, LeaseReleased, MeasurementEvent, KvPeakEvent, EndRun,
                ResponseStored, ResponseDeleted)
}


#: a record the journal writes: a manager event, the end of a run, a stored response's change
Record = ManagerEvent | EndRun | ResponseStored | ResponseDeleted


def encode(event: Record) -> Wire:
    """The wire record of ``event`` (raises KeyError for anything else)."""
    return ENCODERS[type(event)](event)


def decode(w: Wire) -> Record:
    """The event a wire record stands for: ``decode(encode(e)) == e``."""
    code = w[0]
    if code == TRANSITION:
        return TransitionEvent(w[1], State(w[2]), State(w[3]), Reason(w[4]), *w[5:])
    if code == ACQUIRED:
        return LeaseAcquired(*w[1:])
    if code == RELEASED:
        return LeaseReleased(w[1], w[2], Outcome(w[3]), *w[4:])
    if code == MEASUREMENT:
        return MeasurementEvent(*w[1:])
    if code == KV_PEAK:
        return KvPeakEvent(*w[1:])
    if code == END:
        return EndRun(*w[1:])
    if code == STORED:
        return ResponseStored(*w[1:])
    if code == DELETED:
        return ResponseDeleted(*w[1:])
    raise ValueError(f"not a journal wire record: {w!r}")


# ---- the events row's JSON payload --------------------------------------------------------------

#: per published kind: the payload's keys, ``"kind"`` first, then the dataclass fields
_KEYS: dict[str, tuple[str, ...]] = {
    cls.kind: ("kind", *(f.name for f in fields(cls)))
    for cls in (TransitionEvent, LeaseAcquired, LeaseReleased)
}

_ENCODER = json.JSONEncoder(separators=(",", ":"))
#: json's C encoder made once (``JSONEncoder.encode`` makes one per call); the same
#: arguments as ``_ENCODER``'s, so the same bytes as ``json.dumps(..., separators=(",", ":"))``
_C_ENCODE = (
    None
    if c_make_encoder is None
    else c_make_encoder(
        None, _ENCODER.default, encode_basestring_ascii, None, ":", ",", False, False, True
    )
)


def event_json(w: Wire) -> str:
    """``json.dumps(event.as_dict(), separators=(",", ":"))`` of the event ``w`` stands for.

    It follows the dataclass fields (``zip`` is strict), so a new field cannot be
    left out; the journaled property test compares every stored payload with
    ``json.dumps``. Enum members are ``str`` subclasses: json writes their value.
    """
    payload = dict(zip(_KEYS[w[0]], w, strict=True))
    if _C_ENCODE is None:
        return _ENCODER.encode(payload)
    return "".join(_C_ENCODE(payload, 0))


# ---- rows ---------------------------------------------------------------------------------------


def event_row(seq: int, run_id: int, w: Wire) -> tuple[Any, ...]:
    code = w[0]
    at, model = (w[5], w[1]) if code == TRANSITION else (w[5] if code == ACQUIRED else w[4], w[2])
    return (seq, run_id, at, code, model, event_json(w))


def _transition_row(seq: int, run_id: int, w: Wire) -> tuple[Any, ...]:
    _, model, from_state, to_state, reason, at, memory_bytes, error, _cause = w
    return (seq, run_id, at, model, from_state, to_state, reason, memory_bytes, error)


def _lease_row(run_id: int, w: Wire) -> list[Any]:
    _, lease_id, model, request_id, route, at, client = w
    return [lease_id, run_id, model, request_id, route, at, None, None, None, None, client, None]


def _weights_row(w: Wire) -> tuple[Any, ...]:
    _, model, at, _, _, weights = w
    return (model, at, weights)


def _kv_peak_row(run_id: int, w: Wire) -> tuple[Any, ...]:
    _, model, at, *rest = w  # rest: loaded_at, the peak, the budgets, as INSERT_KV_PEAK lists them
    return (model, at, run_id, *rest)


def _release_row(w: Wire) -> tuple[Any, ...]:
    _, lease_id, _, outcome, at, prompt_tokens, completion_tokens, _, kv_wait = w
    return (at, outcome, prompt_tokens, completion_tokens, kv_wait, lease_id)


# ---- from records to SQL (in the writer process) ------------------------------------------------


#: one record as the writer queues it: (seq, run_id, wire record); a plain tuple, made per record
Item = tuple[int, int, Wire]


#: (sql, params, must change exactly one row); an INSERT's sql is ``... VALUES (?, ...)``
Op = tuple[str, tuple[Any, ...], bool]


class Plan(NamedTuple):
    """How to write a whole batch: what :func:`plan` returns."""

    #: (INSERT ... VALUES (?, ...), rows): written as multi-row INSERTs, in this order
    inserts: list[tuple[str, list[tuple[Any, ...]]]]
    #: (UPDATE ..., rows): one statement per row, each must change exactly one row
    updates: list[tuple[str, list[tuple[Any, ...]]]]


class Rejected(Exception):
    """A record the database will never take (retrying cannot help)."""


def prepare(item: Item) -> tuple[Op, ...]:
    """One record's statements, in order: the reference for :func:`plan`."""
    seq, run_id, w = item
    code = w[0]
    if code == END:
        return ((END_RUN, (w[1], 1 if w[2] else 0, run_id), True),)
    if code == MEASUREMENT:
        if w[5] is None:
            return ((INSERT_MEASUREMENT, w[1:5], False),)
        return ((INSERT_MEASUREMENT, w[1:5], False), (INSERT_MEASUREMENT_WEIGHTS, _weights_row(w), False))
    if code == KV_PEAK:
        return ((INSERT_KV_PEAK, _kv_peak_row(run_id, w), False),)
    if code == STORED:
        return ((responses.INSERT_RESPONSE, responses.stored_row(run_id, w), False),)
    if code == DELETED:
        return ((responses.DELETE_RESPONSE, responses.deleted_row(w), False),)
    event_op: Op = (INSERT_EVENT, event_row(seq, run_id, w), False)
    if code == TRANSITION:
        return (event_op, (INSERT_TRANSITION, _transition_row(seq, run_id, w), False))
    if code == ACQUIRED:
        return ((INSERT_LEASE, tuple(_lease_row(run_id, w)), False), event_op)
    if code == RELEASED:
        return ((RELEASE_LEASE, _release_row(w), True), event_op)
    raise Rejected(f"not a journal wire record: {w!r}")


def plan(items: list[Item]) -> Plan:
    """A batch in a few multi-row statements, with the same end state as :func:`prepare` in order.

    A lease acquired and released within the batch is one ``leases`` row (no
    UPDATE). Anything unusual (a lease id acquired twice, an unknown record)
    raises :class:`Rejected`, which sends the batch record by record through
    :func:`prepare`, where the database judges each record alone.
    """
    events: list[tuple[Any, ...]] = []
    transitions: list[tuple[Any, ...]] = []
    leases: dict[str, list[Any]] = {}
    releases: list[tuple[Any, ...]] = []
    measurements: list[tuple[Any, ...]] = []
    weights: list[tuple[Any, ...]] = []
    kv_peaks: list[tuple[Any, ...]] = []
    ends: list[tuple[Any, ...]] = []
    stored: list[tuple[Any, ...]] = []
    for seq, run_id, w in items:
        code = w[0]
        if code == ACQUIRED:
            if w[1] in leases:
                raise Rejected(f"lease {w[1]!r} acquired twice in one batch")
            leases[w[1]] = _lease_row(run_id, w)
        elif code == RELEASED:
            row = leases.get(w[1])
            if row is not None and row[7] is None:  # acquired in this batch and still open
                *row[6:10], row[11], _ = _release_row(w)
            else:
                releases.append(_release_row(w))
        elif code == TRANSITION:
            transitions.append(_transition_row(seq, run_id, w))
        elif code == MEASUREMENT:
            measurements.append(w[1:5])
            if w[5] is not None:
                weights.append(_weights_row(w))
            continue
        elif code == KV_PEAK:
            kv_peaks.append(_kv_peak_row(run_id, w))
            continue
        elif code == END:
            ends.append((w[1], 1 if w[2] else 0, run_id))
            continue
        elif code == STORED:
            stored.append(responses.stored_row(run_id, w))
            continue
        elif code == DELETED:  # rare (a DELETE request), and may change no row: record by record
            raise Rejected("a stored response's deletion is written record by record")
        else:
            raise Rejected(f"not a journal wire record: {w!r}")
        events.append(event_row(seq, run_id, w))
    inserts = [
        (INSERT_EVENT, events),  # before transitions: their seq references it
        (INSERT_TRANSITION, transitions),
        (INSERT_LEASE, [tuple(r) for r in leases.values()]),
        (INSERT_MEASUREMENT, measurements),
        (INSERT_MEASUREMENT_WEIGHTS, weights),
        (INSERT_KV_PEAK, kv_peaks),
        (responses.INSERT_RESPONSE, stored),
    ]
    updates = [(RELEASE_LEASE, releases), (END_RUN, ends)]
    return Plan(
        [(sql, rows) for sql, rows in inserts if rows],
        [(sql, rows) for sql, rows in updates if rows],
    )


# ---- start-up recovery (in the writer process) --------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What :meth:`mlxd.journal.journal.Journal.begin_run` found and repaired.

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


def recover(
    conn: Any, pid: int, version: str, config_path: str | None, now: float, seq: int
) -> tuple[RecoveryReport, list[tuple[int, Wire]]]:
    """Insert this run's ``runs`` row and repair the previous run, in one transaction.

    Recovery rows take sequence numbers from ``seq`` on; returns the report and
    the ``(seq, wire record)`` of each row that has an ``events`` row.
    """
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
    published: list[tuple[int, Wire]] = []
    recovered: list[tuple[str, State]] = []
    for model, state in last:
        if state not in HOLDS_MEMORY:
            continue
        w = encode(TransitionEvent(model, state, State.UNLOADED, Reason.CRASH_RECOVERY, now))
        conn.execute(INSERT_EVENT, event_row(seq, run_id, w))
        conn.execute(INSERT_TRANSITION, _transition_row(seq, run_id, w))
        published.append((seq, w))
        recovered.append((model, state))
        seq += 1
    interrupted: list[str] = []
    for lease_id, model in conn.execute(
        "SELECT id, model FROM leases WHERE released_at IS NULL AND run_id < ?"
        " ORDER BY acquired_at, rowid",
        (run_id,),
    ).fetchall():
        w = encode(LeaseReleased(lease_id, model, Outcome.INTERRUPTED, now))
        conn.execute(RELEASE_LEASE, _release_row(w))
        conn.execute(INSERT_EVENT, event_row(seq, run_id, w))
        published.append((seq, w))
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
