"""A schema v1 journal full of history, written with plain SQL, for migration tests.

The rows are what a v1 daemon wrote: runs that stopped cleanly, each model
cycling ``unloaded -> loading -> loaded -> unloading -> unloaded`` with leases
while it was loaded, every transition and lease event in ``events`` with its
JSON payload, and measurements. Every history is legal (``check_journal`` finds
nothing) and every model ends ``unloaded``.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from mlxd.journal.migrate import discover, split_statements

MODELS = ("alpha", "beta", "gamma")
#: what one cycle of a model writes: 4 transitions, each with its events row
CYCLE = (
    ("unloaded", "loading", "request"),
    ("loading", "loaded", "request"),
    ("loaded", "unloading", "evicted"),
    ("unloading", "unloaded", "evicted"),
)


def write_v1_journal(path: Path, rows: int, *, leases_per_cycle: int = 4, runs: int = 3) -> int:
    """Create ``path`` at schema v1 with about ``rows`` rows in all tables; returns the count.

    One cycle writes 8 transition rows (4 transitions + their events) and 3
    rows per lease (the lease and its two events) plus one measurement.
    """
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("BEGIN")
    for statement in split_statements(discover()[0].path.read_text()):
        conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    per_cycle = 8 + 3 * leases_per_cycle + 1
    cycles = max(1, -(-rows // per_cycle))
    at, seq, lease_no, written = 1_700_000_000.0, 0, 0, 0
    events: list[tuple[object, ...]] = []
    transitions: list[tuple[object, ...]] = []
    leases: list[tuple[object, ...]] = []
    measurements: list[tuple[object, ...]] = []
    per_run = -(-cycles // runs)
    for run in range(1, runs + 1):
        conn.execute(
            "INSERT INTO runs(id, started_at, stopped_at, clean_stop, pid, version, config_path)"
            " VALUES (?, ?, NULL, 0, ?, 'v1-test', NULL)",
            (run, at, 1000 + run),
        )
        for cycle in range(per_run):
            if (run - 1) * per_run + cycle >= cycles:
                break
            model = MODELS[cycle % len(MODELS)]
            for i, (a, b, reason) in enumerate(CYCLE):
                seq += 1
                at += 0.5
                memory = 512 * 1024 * 1024 if b == "loaded" else None
                payload = {"kind": "transition", "model": model, "from_state": a, "to_state": b,
                           "reason": reason, "at": at, "memory_bytes": memory, "error": None}  # fmt: skip
                events.append((seq, run, at, "transition", model, _json(payload)))
                transitions.append((seq, run, at, model, a, b, reason, memory, None))
                if i == 1:
                    measurements.append((model, at, 512 * 1024 * 1024, 0.5))
                    for _ in range(leases_per_cycle):
                        lease_no += 1
                        lid = f"{lease_no:024x}"
                        seq += 1
                        at += 0.01
                        acquired = at
                        events.append((seq, run, at, "lease_acquired", model, _json(
                            {"kind": "lease_acquired", "lease_id": lid, "model": model,
                             "request_id": f"req-{lease_no}", "route": "/v1/chat/completions",
                             "at": at})))  # fmt: skip
                        seq += 1
                        at += 0.02
                        events.append((seq, run, at, "lease_released", model, _json(
                            {"kind": "lease_released", "lease_id": lid, "model": model,
                             "outcome": "completed", "at": at, "prompt_tokens": 7,
                             "completion_tokens": 11, "held_seconds": 0.02})))  # fmt: skip
                        leases.append((lid, run, model, f"req-{lease_no}", "/v1/chat/completions",
                                       acquired, at, "completed", 7, 11))  # fmt: skip
        at += 10
        conn.execute(
            "UPDATE runs SET stopped_at = ?, clean_stop = 1 WHERE id = ?", (at, run)
        )
    conn.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?)", events)
    conn.executemany("INSERT INTO transitions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", transitions)
    conn.executemany("INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", leases)
    conn.executemany("INSERT INTO measurements VALUES (?, ?, ?, ?)", measurements)
    conn.execute("COMMIT")
    written = len(events) + len(transitions) + len(leases) + len(measurements) + runs
    conn.close()
    return written


def _json(payload: dict[str, object]) -> str:
    return json.dumps(payload, separators=(",", ":"))
