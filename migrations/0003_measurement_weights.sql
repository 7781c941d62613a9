-- mlxd journal schema v3: each measurement tied to the weights it was measured on.
-- Only adds (a table, its index, a trigger); the v1/v2 tables are unchanged.
--
-- A measured size belongs to the weights, not to the model's name: after two models swap
-- paths in the config, or a weight file changes, the old size must not be used. `weights` is
-- the fingerprint mlxd.config.weights_fingerprint gave when the size was measured (for a local
-- model: its resolved path and each weight file's relative path, size and mtime; for a Hub
-- model: its repo id). A measurement applies while the model's current fingerprint is the same.
-- The row of measurements(model, at) it belongs to has the same model and at; a measurement
-- without one (journaled before v3, or by a fake engine then) has no known weights.
CREATE TABLE measurement_weights (
    model   TEXT NOT NULL,
    at      REAL NOT NULL,
    weights TEXT NOT NULL
);
CREATE INDEX measurement_weights_model_at ON measurement_weights(model, at);

-- Pruning a measurement (journal retention) takes its fingerprint with it.
CREATE TRIGGER measurements_delete_weights AFTER DELETE ON measurements
BEGIN
    DELETE FROM measurement_weights WHERE model = old.model AND at = old.at;
END;
