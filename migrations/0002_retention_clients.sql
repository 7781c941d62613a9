-- mlxd journal schema v2: retention (checkpoints, the pruning watermark), the client of each
-- lease, and the transition reason 'engine_died'. Applied in one transaction with its
-- user_version bump, like every migration: killed midway, the file stays at v1.
--
-- Incremental vacuum (the file shrinking as old rows are pruned) is not set here: for a file
-- that already has tables, PRAGMA auto_vacuum only takes effect after a VACUUM, and VACUUM
-- cannot run inside a transaction. A new journal gets it when created (open_database sets it
-- before the first table); an older one is converted once, outside any migration, by
-- `mlxd migrate` or at the daemon's start when the file is small (mlxd/journal/retention.py).

-- 'engine_died' joins transitions.reason's CHECK list. SQLite cannot alter a CHECK
-- constraint, so the table is rebuilt (create, copy every row, drop, rename, indexes again).
-- Nothing references transitions, so dropping it breaks no foreign key.
CREATE TABLE transitions_v2 (
    seq          INTEGER PRIMARY KEY REFERENCES events(seq),
    run_id       INTEGER NOT NULL REFERENCES runs(id),
    at           REAL    NOT NULL,
    model        TEXT    NOT NULL,
    from_state   TEXT    NOT NULL CHECK (from_state IN ('unloaded','loading','loaded','draining','unloading','failed')),
    to_state     TEXT    NOT NULL CHECK (to_state   IN ('unloaded','loading','loaded','draining','unloading','failed')),
    reason       TEXT    NOT NULL CHECK (reason IN ('request','preload','admin','restore','idle_timeout','evicted',
                                                    'preempted','abandoned','load_failed','unload_failed','shutdown',
                                                    'crash_recovery','config_reload','engine_died')),
    memory_bytes INTEGER,
    error        TEXT
);
INSERT INTO transitions_v2(seq, run_id, at, model, from_state, to_state, reason, memory_bytes, error)
    SELECT seq, run_id, at, model, from_state, to_state, reason, memory_bytes, error
    FROM transitions ORDER BY seq;
DROP TABLE transitions;
ALTER TABLE transitions_v2 RENAME TO transitions;
CREATE INDEX transitions_model_seq ON transitions(model, seq);
CREATE INDEX transitions_at ON transitions(at);
CREATE INDEX transitions_run ON transitions(run_id, seq);

-- The name of the API key that took the lease (server.keys[].name; 'default' for
-- server.api_key_env), never the key itself. NULL when the daemon runs without keys,
-- and for every lease journaled before v2.
ALTER TABLE leases ADD COLUMN client TEXT;

-- Retention: where each model's pruned history ended. One row per model that has lost
-- transitions to pruning: `seq`, `run_id` and `at` of its last pruned transition, and `state`,
-- that row's to_state, which is where the model's kept history starts (its oldest kept
-- transition starts from it). Replaying a model = start at `state`, apply its kept rows.
-- `pruned` counts the model's transitions pruned so far.
CREATE TABLE checkpoints (
    model   TEXT    PRIMARY KEY,
    seq     INTEGER NOT NULL,
    run_id  INTEGER NOT NULL REFERENCES runs(id),
    at      REAL    NOT NULL,
    state   TEXT    NOT NULL CHECK (state IN ('unloaded','loading','loaded','draining','unloading','failed')),
    pruned  INTEGER NOT NULL DEFAULT 0
);

-- One row: how far pruning has gone. Every events row with seq <= pruned_through may be gone
-- (kept below it: each model's latest transition), so /admin/events answers a Last-Event-ID
-- below it with a "gap" event first. The counts are totals since the file was created.
CREATE TABLE retention (
    id                  INTEGER PRIMARY KEY CHECK (id = 1),
    pruned_through      INTEGER NOT NULL DEFAULT 0,
    pruned_at           REAL,
    events_pruned       INTEGER NOT NULL DEFAULT 0,
    transitions_pruned  INTEGER NOT NULL DEFAULT 0,
    leases_pruned       INTEGER NOT NULL DEFAULT 0,
    measurements_pruned INTEGER NOT NULL DEFAULT 0
);
INSERT INTO retention(id) VALUES (1);
