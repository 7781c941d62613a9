"""The crash-loop supervisor: start the real daemon, drive it, SIGKILL it, check the journal, repeat.

One :class:`CrashLoop` owns a temporary directory with a config of four fake
models, a budget that forces evictions and preemption, ``restore_on_start``,
and journal retention (``max_mb`` small enough that every start prunes). The
journal starts as a schema v1 file with 20,000 rows of older history, so the
first start (armed at ``migrate.mid_migration``) dies inside the real 0002 on a
journal with history, and pruning runs from the first start on.
Each *start* runs ``mlxd serve`` on 127.0.0.1 port 0 and ends in a SIGKILL:

* ``random``: the supervisor kills it at a random moment, while it serves
  traffic or (one time in four) during start-up, counted from the process start;
* a named crash point (:mod:`mlxd.crash_points`): the daemon kills itself there
  (``MLXD_CRASH_AT=point:N``); ``migrate.mid_migration`` starts it with a test
  migration pending (``MLXD_MIGRATIONS_DIR``) so every such start dies inside it;
  ``journal.mid_prune`` dies inside a pruning slice.

While a start serves, three client threads send admin loads and unloads (some
with ``?preempt=true``) and chat requests (some streaming). Each admin reply
200 is an *acknowledgement*: that model reached ``loaded`` (or ``unloaded``)
between the request and the reply, and the daemon replies only after the row
saying so is committed.

After each death, once the dead daemon's journal writer process has finished
(it writes what the daemon had handed it, then exits and frees
``journal.db.lock``; a restart waits for that lock too), the database is
opened read-only, so the hot WAL is left for the next start to recover:

* the exit was SIGKILL, by the named point when one was armed;
* the schema is at a version a migration ends at (no half-applied migration);
* ``PRAGMA integrity_check`` is ``ok`` and :func:`mlxd.journal.replay.check_journal`
  finds nothing (every model's history legal, recovery rows included);
* every acknowledged transition is in the journal (the model's journaled state,
  from its retention checkpoint on, is the acknowledged one at some moment
  between request and reply).

After each restart reaches ready (``/health`` says ``ready: true``):

* the new run wrote one ``crash_recovery`` row for exactly each model whose last
  state held memory, and closed every lease left open (``interrupted``);
* ``/v1/models`` shows loaded exactly the models restore loaded in this run,
  and those are the previous run's resident set (``loaded``/``draining``) plus
  the preload model, pinned and preload first, within the budget.

The read-only view of the journal lives in :mod:`tests.crash.journal_view`,
the client threads in :mod:`tests.crash.traffic`.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mlxd.journal.migrate import discover, open_readonly, split_statements
from mlxd.journal.replay import check_journal
from mlxd.residency.states import HOLDS_MEMORY
from mlxd.resources import migrations_dir
from tests.crash.journal_view import Ack, Snapshot, ack_is_journaled, ack_was_pruned, snapshot
from tests.crash.traffic import Traffic
from tests.support.daemon import MLXD, REPO, write_config
from tests.support.old_journal import write_v1_journal

BUDGET_GB = 3
#: name -> (GB, load s, unload s, preload, pin, idle unload s)
MODELS: dict[str, tuple[int, float, float, bool, bool, float]] = {
    "alpha": (1, 0.05, 0.05, True, False, 0.0),
    "beta": (1, 0.10, 0.05, False, True, 0.0),
    "gamma": (2, 0.30, 0.10, False, False, 0.0),
    "delta": (1, 0.15, 0.08, False, False, 4.0),
}
#: journal.max_mb of the loop: small enough that every start prunes (the file starts with
#: PREFILL_ROWS rows of old v1 history), big enough to keep many starts of rows
PRUNE_MAX_MB = 1
PREFILL_ROWS = 20_000

#: each named point and the range its N is drawn from
POINTS: dict[str, tuple[int, int]] = {
    "journal.before_commit": (1, 40),
    "journal.after_commit": (1, 40),
    "http.after_commit_before_reply": (1, 6),
    "manager.mid_load": (1, 5),
    "manager.mid_unload": (1, 4),
    "migrate.mid_migration": (1, 6),  # the test migration below has six statements
    "journal.mid_prune": (1, 3),
}

#: a pending migration for the ``migrate.mid_migration`` starts; never allowed to finish
TEST_MIGRATION = """\
CREATE TABLE crash_probe (id INTEGER PRIMARY KEY, model TEXT NOT NULL, n INTEGER NOT NULL);
INSERT INTO crash_probe(model, n) SELECT model, count(*) FROM transitions GROUP BY model;
CREATE INDEX crash_probe_model ON crash_probe(model);
ALTER TABLE runs ADD COLUMN crash_probe_note TEXT;
UPDATE runs SET crash_probe_note = 'migrated';
CREATE VIEW crash_probe_view AS SELECT model, n FROM crash_probe;
"""

#: statements in the real first migration
INIT_STATEMENTS = len(list(split_statements((migrations_dir() / "0001_init.sql").read_text())))
#: statements in all the real migrations (a fresh file's mid-migration kill picks one: it dies
#: inside 0001 or, with 0001 committed, inside a later one)
ALL_STATEMENTS = sum(len(list(split_statements(m.path.read_text()))) for m in discover())

#: the schema version the real migrations end at; the test migration is the one after it
LATEST = len(discover())


def _schemas() -> dict[int, tuple[str, ...]]:
    """For each version 0..LATEST, the names in ``sqlite_master`` a file at that version has."""
    out: dict[int, tuple[str, ...]] = {}
    for version in range(LATEST + 1):
        conn = sqlite3.connect(":memory:", isolation_level=None)
        for m in discover()[:version]:
            for statement in split_statements(m.path.read_text()):
                conn.execute(statement)
        out[version] = tuple(
            r[0] for r in conn.execute("SELECT name FROM sqlite_master ORDER BY name")
        )
        conn.close()
    return out


#: version -> the schema's names: after a kill, a file must have exactly those of its version
SCHEMAS = _schemas()
TEST_MIGRATION_NAME = f"{LATEST + 1:04d}_crash_probe.sql"


def with_test_migration(folder: Path) -> Path:
    """``folder`` holding the real migrations and, after them, :data:`TEST_MIGRATION`."""
    folder.mkdir(exist_ok=True)
    for m in discover():
        shutil.copy(m.path, folder / m.name)
    (folder / TEST_MIGRATION_NAME).write_text(TEST_MIGRATION)
    return folder

READY_TIMEOUT_S = 30.0
#: a dead daemon's journal writer must have exited within this (it writes one batch at most)
WRITER_EXIT_TIMEOUT_S = 10.0

#: a start armed with a named point that has not died by then is killed by the supervisor
NAMED_TIMEOUT_S = 8.0


def config(journal: Path) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "shutdown_grace_s": 1},
        "journal": {
            "path": str(journal), "synchronous": "full", "retain_days": 0, "max_mb": PRUNE_MAX_MB,
        },
        "manager": {
            "memory_budget_gb": BUDGET_GB,
            "restore_on_start": True,
            "contention_policy": {
                "strategy": "wait_then_preempt",
                "wait_timeout_s": 3,
                "preempt_after_s": 0.2,
            },
        },
        "models": [
            {
                "name": name,
                "engine": "fake",
                "estimated_memory_gb": gb,
                "preload": preload,
                "pin": pin,
                "idle_unload_seconds": idle,
                "fake": {
                    "load_seconds": load_s,
                    "unload_seconds": unload_s,
                    "tokens_per_second": 100,
                },
            }
            for name, (gb, load_s, unload_s, preload, pin, idle) in MODELS.items()
        ],
    }


def expected_restore(resident: list[str]) -> set[str]:
    """What a start must restore: preload models, then the previous resident set, pinned first, within the budget."""
    wanted = [m for m, spec in MODELS.items() if spec[3]]
    wanted += [m for m in resident if m not in wanted and m in MODELS]
    first = sorted(wanted, key=lambda m: not (MODELS[m][3] or MODELS[m][4]))
    room, out = BUDGET_GB, set()
    for m in first:
        if MODELS[m][0] <= room:
            room -= MODELS[m][0]
            out.add(m)
    return out


# ---- the loop -------------------------------------------------------------------------------


@dataclass
class Summary:
    kills: Counter[str] = field(default_factory=Counter)
    unreached: Counter[str] = field(default_factory=Counter)
    died_before_ready: Counter[str] = field(default_factory=Counter)
    ready_s: list[float] = field(default_factory=list)
    #: from the daemon's death to its journal writer's exit (the lock freed)
    writer_exit_s: list[float] = field(default_factory=list)
    acks: int = 0
    lost_acks: int = 0
    #: acks whose rows retention pruned before the check (not checkable; should stay 0)
    pruned_acks: int = 0
    #: events rows retention pruned over the whole loop (the file's total)
    events_pruned: int = 0
    illegal_pairs: int = 0
    dangling_leases: int = 0
    wrong_restores: int = 0
    restored: int = 0
    recovered_rows: int = 0
    interrupted_leases: int = 0
    #: of those, already pruned by retention when the start was checked
    pruned_interrupted: int = 0
    #: models whose recovery row retention pruned before the start was checked (not checkable)
    pruned_recoveries: int = 0
    #: models restored whose restore row retention had pruned by the start's check
    pruned_restores: int = 0
    requests: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    seed: int = 0

    @property
    def total(self) -> int:
        return sum(self.kills.values())

    def percentile(self, q: float, values: list[float] | None = None) -> float:
        values = self.ready_s if values is None else values
        if not values:
            return float("nan")
        if len(values) == 1:
            return values[0]
        return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]

    def markdown(self) -> str:
        lines = [
            f"Kills: {self.total:,} in {self.seconds:.0f} s (seed {self.seed}).",
            "",
            "| kill | count | of which before ready |",
            "|---|---:|---:|",
        ]
        for kind, n in sorted(self.kills.items()):
            lines.append(f"| {kind} | {n:,} | {self.died_before_ready[kind]:,} |")
        lines += [
            "",
            "| check | result |",
            "|---|---|",
            f"| acknowledged admin transitions | {self.acks:,} |",
            f"| lost acknowledged transitions | **{self.lost_acks}** |",
            f"| events rows pruned by retention (journal.max_mb {PRUNE_MAX_MB}) / acks not checkable because pruned | {self.events_pruned:,} / {self.pruned_acks} |",
            f"| illegal pairs in model histories | **{self.illegal_pairs}** |",
            f"| leases left open by a dead run after restart | **{self.dangling_leases}** |",
            f"| restarts whose restore or /v1/models was wrong | **{self.wrong_restores}** |",
            f"| crash_recovery rows written / leases closed as interrupted (already pruned at the check) | {self.recovered_rows:,} ({self.pruned_recoveries}) / {self.interrupted_leases:,} ({self.pruned_interrupted}) |",
            f"| models restored at ready (restore row already pruned at the check) | {self.restored:,} ({self.pruned_restores}) |",
            f"| restart-to-ready (process start to /health ready), n={len(self.ready_s):,} | p50 {self.percentile(50) * 1000:.0f} ms, p99 {self.percentile(99) * 1000:.0f} ms, max {max(self.ready_s, default=float('nan')) * 1000:.0f} ms |",
            f"| the dead daemon's journal writer gone after the kill | p50 {self.percentile(50, self.writer_exit_s) * 1000:.1f} ms, p99 {self.percentile(99, self.writer_exit_s) * 1000:.1f} ms, max {max(self.writer_exit_s, default=float('nan')) * 1000:.0f} ms |",
            f"| named points not reached (supervisor killed instead) | {sum(self.unreached.values())} |",
            f"| requests sent | {', '.join(f'{k} {v:,}' for k, v in sorted(self.requests.items()))} |",
            f"| violations | {len(self.violations)} |",
        ]
        return "\n".join(lines)


class CrashLoop:
    def __init__(self, tmp: Path, seed: int) -> None:
        self.tmp = tmp
        self.rng = random.Random(seed)
        self.journal = tmp / "journal.db"
        write_v1_journal(self.journal, PREFILL_ROWS)  # old history: 0002 to apply, rows to prune
        self.config_path = write_config(tmp / "models.yaml", config(self.journal))
        self.log_path = tmp / "daemon.log"
        self.test_migrations = with_test_migration(tmp / "migrations")
        self.summary = Summary(seed=seed)
        self.proc: subprocess.Popen[bytes] | None = None
        self._http = httpx.Client(timeout=5)

    # -- one process ---------------------------------------------------------------------

    def _spawn(self, env: dict[str, str]) -> tuple[Path, int]:
        ready = self.tmp / f"ready-{time.monotonic_ns()}"
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*MLXD, "serve", "--config", str(self.config_path), "--port", "0",
                 "--ready-file", str(ready), "--log-level", "warning"],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                env={**os.environ, "MLXD_STATE_DIR": str(self.tmp / "state"), **env},
            )  # fmt: skip
        return ready, offset

    def _wait_ready(self, ready: Path, t0: float, kill_at: float | None) -> str | None:
        """The URL once /health says ready; None if the process died (or was killed at ``kill_at``) first."""
        assert self.proc is not None
        url = ""
        while time.monotonic() - t0 < READY_TIMEOUT_S:
            if kill_at is not None and time.monotonic() >= kill_at:
                self.kill()
            if self.proc.poll() is not None:
                return None
            if not url:
                if ready.exists() and (text := ready.read_text().strip()):
                    url = text
                else:
                    time.sleep(0.005)
                    continue
            try:
                if self._http.get(url + "/health").json().get("ready"):
                    return url
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.005)
        raise TimeoutError(f"not ready after {READY_TIMEOUT_S} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)

    def wait_writer_gone(self, offset: int) -> None:
        """Wait for the dead daemon's journal writer to free the journal's lock (what a restart does)."""
        lock_path = self.journal.with_name(self.journal.name + ".lock")
        if not lock_path.exists():
            return
        t0 = time.monotonic()
        with open(lock_path, "a+") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    if time.monotonic() - t0 > WRITER_EXIT_TIMEOUT_S:
                        self.violation("the dead daemon's journal writer did not exit", offset)
                        return
                    time.sleep(0.002)
                    continue
                fcntl.flock(lock, fcntl.LOCK_UN)
                break
        self.summary.writer_exit_s.append(time.monotonic() - t0)

    def _log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def violation(self, text: str, offset: int | None = None) -> None:
        tail = "" if offset is None else "\n    log: " + self._log_since(offset)[-1500:]
        self.summary.violations.append(text + tail)

    # -- one cycle -------------------------------------------------------------------------

    def cycle(self, kind: str) -> None:
        before = snapshot(self.journal)
        env: dict[str, str] = {}
        armed = None
        if kind != "random":
            lo, hi = POINTS[kind]
            if kind == "migrate.mid_migration" and before.version == 0:
                hi = ALL_STATEMENTS  # a fresh file: die inside 0001, or 0002 with 0001 done
            armed = f"{kind}:{self.rng.randint(lo, hi)}"
            env["MLXD_CRASH_AT"] = armed
            if kind == "migrate.mid_migration" and before.version > 0:
                env["MLXD_MIGRATIONS_DIR"] = str(self.test_migrations)
        startup_kill = kind == "random" and self.rng.random() < 0.25
        t0 = time.monotonic()
        # a random kill: during start-up (from the process start) or while serving (from ready)
        kill_at = t0 + self.rng.uniform(0.0, 1.0) if startup_kill else None
        ready, offset = self._spawn(env)
        try:
            url = self._wait_ready(ready, t0, kill_at)
        except TimeoutError as e:
            self.violation(f"{kind}: {e}", offset)
            url = None
            self.kill()
        traffic = None
        if url is not None:
            self.summary.ready_s.append(time.monotonic() - t0)
            try:
                self.check_start(before, url, offset)
            except httpx.HTTPError:
                pass  # a named point fired while the start was checked: it is counted below
            assert self.proc is not None
            if self.proc.poll() is None:
                traffic = Traffic(url, self.rng, list(MODELS))
                traffic.start()
                if armed is not None:
                    try:
                        self.proc.wait(NAMED_TIMEOUT_S)
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    rest = (kill_at - time.monotonic()) if kill_at else self.rng.uniform(0.1, 2.5)
                    time.sleep(max(0.0, rest))
        died_by_itself = self.proc is not None and self.proc.poll() is not None
        self.kill()
        if traffic is not None:
            traffic.stop()
            self.summary.requests.update(traffic.sent)
        self.record_kill(
            kind, armed, died_by_itself and armed is not None, url is None, offset, startup_kill
        )
        self.wait_writer_gone(offset)
        self.check_after_kill(kind, traffic.acks if traffic else [], offset)

    def record_kill(
        self,
        kind: str,
        armed: str | None,
        by_itself: bool,
        before_ready: bool,
        offset: int,
        startup: bool,
    ) -> None:
        assert self.proc is not None
        if self.proc.returncode != -signal.SIGKILL:
            self.violation(f"{kind}: exit code {self.proc.returncode}, not SIGKILL", offset)
        if armed is not None and by_itself:
            if f"crash point {armed} reached" not in self._log_since(offset):
                self.violation(f"{armed}: the daemon died but not at its crash point", offset)
            label = kind
        elif armed is not None:
            self.summary.unreached[kind] += 1
            label = "random (serving)"
        else:
            label = "random (start-up)" if startup else "random (serving)"
        self.summary.kills[label] += 1
        if before_ready:
            self.summary.died_before_ready[label] += 1

    def check_after_kill(self, kind: str, acks: list[Ack], offset: int) -> None:
        snap = snapshot(self.journal)
        if not snap.exists:
            if acks:
                self.violation(f"{kind}: {len(acks)} acknowledged transitions but no journal file")
            return
        if snap.integrity != ["ok"]:
            self.violation(f"{kind}: integrity_check: {snap.integrity}", offset)
        if SCHEMAS.get(snap.version) != snap.tables or snap.probe_column:
            self.violation(
                f"{kind}: schema between versions: v{snap.version}, {snap.tables}", offset
            )
        if snap.version == 0:
            return
        self.summary.illegal_pairs += snap.illegal
        for p in snap.problems:
            self.violation(f"{kind}: after the kill: {p}", offset)
        self.summary.acks += len(acks)
        self.summary.events_pruned = snap.events_pruned
        for ack in acks:
            if ack_was_pruned(snap, ack):
                self.summary.pruned_acks += 1
            elif not ack_is_journaled(snap, ack):
                self.summary.lost_acks += 1
                self.violation(f"{kind}: acknowledged but not journaled: {ack}", offset)

    def check_start(self, before: Snapshot, url: str, offset: int) -> None:
        """Recovery and restore of the start that just reached ready (nothing else has run yet)."""
        models = {m["id"]: m for m in self._http.get(url + "/v1/models").json()["data"]}
        loaded = {m for m, obj in models.items() if obj["loaded"]}
        # Ready comes when the restores are satisfied; their `loaded` rows commit a moment later.
        deadline = time.monotonic() + 5.0
        while True:
            snap = snapshot(self.journal)
            rows = snap.rows_of_run(snap.max_run)
            if loaded <= {r[3] for r in rows if r[5] == "loaded"} or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        for p in snap.problems:
            self.violation(f"start: {p}", offset)
        run = snap.max_run
        if run <= before.max_run:
            self.violation(f"start: no new run row (runs {before.max_run} -> {run})", offset)
            return
        recovered = {(r[3], r[4]) for r in rows if r[6] == "crash_recovery"}
        held = {(m, s) for m, (_, s) in before.last_states().items() if s in HOLDS_MEMORY}
        self.summary.recovered_rows += len(recovered)
        # A restore supersedes its model's recovery row, so retention may prune it before this
        # check; the model's checkpoint then lies in this run. Those models are not checkable.
        pruned = {m for m, r in snap.checkpoint_runs.items() if r == run}
        self.summary.pruned_recoveries += len({m for m, _ in held} & pruned)
        recovered = {(m, s) for m, s in recovered if m not in pruned}
        held = {(m, s) for m, s in held if m not in pruned}
        if recovered != held:
            self.violation(
                f"start: crash_recovery rows {sorted(recovered)} != held {sorted(held)}", offset
            )
        dangling = [
            i for i, (r, released, _) in snap.leases.items() if released is None and r < run
        ]
        self.summary.dangling_leases += len(dangling)
        if dangling:
            self.violation(f"start: leases of dead runs still open: {dangling}", offset)
        was_open = [i for i, (_, released, _) in before.leases.items() if released is None]
        self.summary.interrupted_leases += len(was_open)
        # Recovery closes them, so retention (which prunes released leases only) may already
        # have pruned one; it must have counted it.
        gone = [i for i in was_open if i not in snap.leases]
        self.summary.pruned_interrupted += len(gone)
        if len(gone) > snap.leases_pruned - before.leases_pruned:
            self.violation(f"start: leases left open vanished unpruned: {gone}", offset)
        if any(snap.leases[i][2] != "interrupted" for i in was_open if i in snap.leases):
            self.violation("start: a lease left open was not closed as interrupted", offset)
        assert self.proc is not None
        if self.proc.poll() is not None and not loaded <= {r[3] for r in rows if r[5] == "loaded"}:
            return  # a named point killed it right after ready, before the restore's rows landed
        restored = {r[3] for r in rows if r[5] == "loading" and r[6] in ("restore", "preload")}
        loaded_rows = {r[3] for r in rows if r[5] == "loaded"}
        expected = expected_restore(before.resident())
        # the same holds for a restore's loading row, superseded by its loaded row
        unseen = (expected & pruned) - restored
        self.summary.restored += len(restored | unseen)
        self.summary.pruned_restores += len(unseen)
        if not (loaded == expected and restored | unseen == expected and loaded <= loaded_rows):
            self.summary.wrong_restores += 1
            self.violation(
                f"start: /v1/models loaded {sorted(loaded)}, restore rows {sorted(restored)}, "
                f"expected {sorted(expected)} from resident {before.resident()}, "
                f"checkpoints in this run {sorted(pruned)}",
                offset,
            )

    # -- the whole loop --------------------------------------------------------------------

    def run(self, schedule: list[str]) -> Summary:
        t0 = time.monotonic()
        try:
            for kind in schedule:
                self.cycle(kind)
            self.final_clean_stop()
        finally:
            self.kill()
            self._http.close()
        self.summary.seconds = time.monotonic() - t0
        return self.summary

    def final_clean_stop(self) -> None:
        """After the last kill: one more recovery, then a graceful stop that leaves a clean run."""
        before = snapshot(self.journal)
        t0 = time.monotonic()
        ready, offset = self._spawn({})
        url = self._wait_ready(ready, t0, None)
        if url is None:
            self.violation("final start died", offset)
            return
        self.summary.ready_s.append(time.monotonic() - t0)
        self.check_start(before, url, offset)
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        if self.proc.wait(30) != 0:
            self.violation(f"final SIGTERM: exit code {self.proc.returncode}", offset)
        conn = open_readonly(self.journal)
        try:
            clean = conn.execute("SELECT clean_stop FROM runs ORDER BY id DESC LIMIT 1").fetchone()[
                0
            ]
            problems = check_journal(conn)
        finally:
            conn.close()
        if clean != 1 or problems:
            self.violation(f"final stop: clean_stop={clean}, problems {problems}", offset)


def schedule(rng: random.Random, random_kills: int, per_point: int) -> list[str]:
    """The kinds of the cycles in a random order; a fresh file is first killed inside its first migration."""
    kinds = ["random"] * random_kills + [p for p in POINTS for _ in range(per_point)]
    rng.shuffle(kinds)
    return ["migrate.mid_migration", *kinds]
