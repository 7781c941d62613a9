"""Retention keeps history right: a pruned journal replays from its checkpoints to the whole one's state.

Hypothesis draws a history (legal residency walks of up to four models, crash
recovery rows among them, and leases, some never released) with increasing
times, writes it with the journal's own plan into a schema v2 database, then
prunes it with the real :class:`~mlxd.journal.retention.Pruner` (an age cutoff
anywhere in the history, slices of random sizes) and checks:

* replaying the kept rows from the checkpoints gives every model the state
  replaying the whole history gives, and the kept history is legal from them;
* at every kept transition, the model's state is the one the whole history
  had at that seq (so ``mlxd history`` tells the same story from there on);
* a model's latest transition and every open lease are kept;
* the ``gap`` event for a resume from 0 gives every model's state at the
  watermark, as the whole history had it.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from mlxd.journal import retention
from mlxd.journal.migrate import migrate
from mlxd.journal.reads import read_checkpoints, read_gap, read_transitions
from mlxd.journal.replay import check_history, replay
from mlxd.journal.retention import Policy, Pruner
from mlxd.journal.rows import Item, encode, plan
from mlxd.journal.writer import Writer
from mlxd.residency.events import LeaseAcquired, LeaseReleased, TransitionEvent
from mlxd.residency.states import HOLDS_MEMORY, TRANSITIONS, Outcome, Reason, State

MODELS = ("a", "b", "c", "d")


@st.composite
def histories(draw: st.DrawFn) -> list[Any]:
    """Events in journal order: legal walks per model, crash recovery, leases."""
    states = dict.fromkeys(MODELS, State.UNLOADED)
    open_leases: list[tuple[str, str]] = []
    events: list[Any] = []
    at = 1000.0
    for i in range(draw(st.integers(1, 80))):
        at += draw(st.floats(0.0, 100.0))
        op = draw(st.sampled_from(("move", "move", "acquire", "release", "crash")))
        model = draw(st.sampled_from(MODELS))
        if op == "move":
            to = draw(st.sampled_from(sorted(TRANSITIONS[states[model]])))
            events.append(TransitionEvent(model, states[model], to, Reason.REQUEST, at))
            states[model] = to
        elif op == "crash" and states[model] in HOLDS_MEMORY:
            events.append(
                TransitionEvent(model, states[model], State.UNLOADED, Reason.CRASH_RECOVERY, at)
            )
            states[model] = State.UNLOADED
        elif op == "acquire":
            lid = f"L{i:04d}"
            open_leases.append((lid, model))
            events.append(LeaseAcquired(lid, model, None, "/v1/completions", at))
        elif op == "release" and open_leases:
            lid, m = open_leases.pop(draw(st.integers(0, len(open_leases) - 1)))
            events.append(LeaseReleased(lid, m, Outcome.COMPLETED, at, 1, 2))
    return events


def _write(events: list[Any]) -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    migrate(conn)
    conn.execute("INSERT INTO runs(id, started_at, pid, version) VALUES (1, 0, 1, 't')")
    items: list[Item] = [(seq, 1, encode(e)) for seq, e in enumerate(events, start=1)]
    conn.execute("BEGIN")
    Writer._write(conn, plan(items))
    conn.execute("COMMIT")
    return conn


def _states_by_seq(rows: list[dict[str, Any]]) -> dict[int, dict[str, State]]:
    """After each transition's seq, every model's state (whole history)."""
    states: dict[str, State] = {}
    out: dict[int, dict[str, State]] = {}
    for r in rows:
        states[r["model"]] = State(r["to_state"])
        out[r["seq"]] = dict(states)
    return out


@given(histories(), st.floats(0.0, 1.0), st.lists(st.integers(4, 64), min_size=1, max_size=8))
def test_a_pruned_journal_replays_from_its_checkpoints_like_the_whole_one(
    events: list[Any], where: float, batches: list[int]
) -> None:
    """Replaying kept rows from checkpoints equals replaying everything; kept history stays legal and right."""
    conn = _write(events)
    whole = read_transitions(conn, limit=None)
    by_seq = _states_by_seq(whole)
    times = [e.at for e in events] or [0.0]
    cutoff = min(times) + where * (max(times) - min(times) + 1)
    pruner = Pruner(Policy(retain_days=1.0), clock=lambda: cutoff + 86400.0)
    for k in range(1000):
        pruner.batch = batches[k % len(batches)]
        conn.execute("BEGIN")
        done = pruner.slice(conn, 1.0)
        conn.execute("COMMIT")
        if done is None:
            break
    kept = read_transitions(conn, limit=None)
    checkpoints = read_checkpoints(conn)

    assert replay(kept, checkpoints) == replay(whole)
    assert check_history(kept, checkpoints) == []
    states = {m: State(s) for m, s in checkpoints.items()}
    for r in kept:
        states[r["model"]] = State(r["to_state"])
        assert states[r["model"]] == by_seq[r["seq"]][r["model"]]
    latest = {r["model"]: r["seq"] for r in whole}
    assert {r["model"]: r["seq"] for r in kept} == latest  # every model's latest row is kept
    open_ids = {
        e.lease_id for e in events if isinstance(e, LeaseAcquired)
    } - {e.lease_id for e in events if isinstance(e, LeaseReleased)}
    kept_leases = {r[0] for r in conn.execute("SELECT id FROM leases")}
    assert open_ids <= kept_leases
    through = retention.pruned_through(conn)
    # the pruner's cutoff is its clock minus a day: (cutoff + 86400) - 86400, which float
    # rounding can put a hair away from ``cutoff`` (4e-13 s was seen at cutoff ~1049)
    applied = (cutoff + 86400.0) - 86400.0
    assert all(e.at >= applied for seq, e in enumerate(events, start=1) if seq > through)
    gap = read_gap(conn, 0)
    if through == 0:
        assert gap is None
    else:
        assert gap is not None and gap["through"] == through
        at_through = {}
        for r in whole:
            if r["seq"] <= through:
                at_through[r["model"]] = r["to_state"]
        assert gap["states"] == at_through
