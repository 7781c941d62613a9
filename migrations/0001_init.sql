-- mlxd journal schema v1. Public contract: users query these tables with sqlite3.
-- Times are unix epoch seconds (REAL). Applied in one transaction with its user_version bump.

CREATE TABLE runs (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    started_at  REAL    NOT NULL,
    stopped_at  REAL,
    clean_stop  INTEGER NOT NULL DEFAULT 0 CHECK (clean_stop IN (0, 1)),
    pid         INTEGER NOT NULL,
    version     TEXT    NOT NULL,
    config_path TEXT
);

-- Every journaled happening in one sequence, for /admin/events and Last-Event-ID:
-- seq is the event id (strictly increasing, not dense: a measurement or the end of
-- a run takes a number but has no row here); kind is transition | lease_acquired |
-- lease_released; payload is the event as JSON.
CREATE TABLE events (
    seq     INTEGER PRIMARY KEY,
    run_id  INTEGER NOT NULL REFERENCES runs(id),
    at      REAL    NOT NULL,
    kind    TEXT    NOT NULL CHECK (kind IN ('transition','lease_acquired','lease_released')),
    model   TEXT,
    payload TEXT    NOT NULL
);

-- One row per residency transition; seq is the journal sequence: the transition's
-- events row has the same seq (its /admin/events id).
CREATE TABLE transitions (
    seq          INTEGER PRIMARY KEY REFERENCES events(seq),
    run_id       INTEGER NOT NULL REFERENCES runs(id),
    at           REAL    NOT NULL,
    model        TEXT    NOT NULL,
    from_state   TEXT    NOT NULL CHECK (from_state IN ('unloaded','loading','loaded','draining','unloading','failed')),
    to_state     TEXT    NOT NULL CHECK (to_state   IN ('unloaded','loading','loaded','draining','unloading','failed')),
    reason       TEXT    NOT NULL CHECK (reason IN ('request','preload','admin','restore','idle_timeout','evicted',
                                                    'preempted','abandoned','load_failed','unload_failed','shutdown',
                                                    'crash_recovery','config_reload')),
    memory_bytes INTEGER,
    error        TEXT
);
CREATE INDEX transitions_model_seq ON transitions(model, seq);
CREATE INDEX transitions_at ON transitions(at);
CREATE INDEX transitions_run ON transitions(run_id, seq);

-- One row per lease: inserted when acquired, completed when released.
CREATE TABLE leases (
    id                TEXT    PRIMARY KEY,
    run_id            INTEGER NOT NULL REFERENCES runs(id),
    model             TEXT    NOT NULL,
    request_id        TEXT,
    route             TEXT,
    acquired_at       REAL    NOT NULL,
    released_at       REAL,
    outcome           TEXT CHECK (outcome IS NULL OR outcome IN ('completed','error','cancelled','disconnected',
                                                                 'preempted','shutdown','interrupted')),
    prompt_tokens     INTEGER,
    completion_tokens INTEGER
);
CREATE INDEX leases_model_acquired ON leases(model, acquired_at);
CREATE INDEX leases_acquired ON leases(acquired_at);
CREATE INDEX leases_open ON leases(run_id) WHERE released_at IS NULL;

-- The footprint and load time measured after each successful load.
CREATE TABLE measurements (
    model        TEXT NOT NULL,
    at           REAL NOT NULL,
    memory_bytes INTEGER NOT NULL,
    load_seconds REAL NOT NULL
);
CREATE INDEX measurements_model_at ON measurements(model, at);
