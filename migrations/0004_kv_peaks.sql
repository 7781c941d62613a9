-- mlxd journal schema v4: how much of its KV budgets each residency really used.
-- Only adds (a table, its index, one retention counter). The v1-v3 tables and rows are unchanged.
--
-- A loaded model commits weights + kv_cache + prompt_cache bytes: kv_cache_gb and
-- prompt_cache_gb, or their defaults from the model's config.json. Those are budgets,
-- counted whether or not a generation ever fills them. A row here says what one residency
-- used of them, so that kv_cache_gb can be set from what was measured.
--
-- One row per residency of a model whose engine measures its KV (mlx-lm models that batch:
-- max_batch_size > 1 and a KV cache mlx-lm can batch. Fake, vision, process-isolated and
-- one-at-a-time models write none.). It is written when the residency ends, once its engine
-- stop has succeeded: unload, idle timeout, eviction, the end of a preemption's drain,
-- shutdown. The peak is read just before that stop (it frees the caches that hold it), so
-- it covers the whole residency. A model whose engine died, whose load failed, or whose stop
-- was still hanging when a shutdown gave up, writes none.
CREATE TABLE kv_peaks (
    model                     TEXT    NOT NULL,
    -- when the engine stop that ended the residency began
    at                        REAL    NOT NULL,
    run_id                    INTEGER NOT NULL REFERENCES runs(id),
    -- when the residency became loaded
    loaded_at                 REAL    NOT NULL,
    -- the most KV bytes the running generations held at once (sampled after each decode step)
    kv_peak_bytes             INTEGER NOT NULL,
    -- the kv_cache part of what the load committed (kv_cache_gb or its default)
    kv_budget_bytes           INTEGER NOT NULL,
    -- what the prompt cache held at the end (it evicts beyond its budget: about its most)
    prompt_cache_bytes        INTEGER NOT NULL,
    -- the prompt_cache part of what the load committed (prompt_cache_gb or its default)
    prompt_cache_budget_bytes INTEGER NOT NULL
);
CREATE INDEX kv_peaks_model_at ON kv_peaks(model, at);

-- Retention prunes kv_peaks like measurements (older rows, never a model's latest). This
-- counts the rows pruned since the file was created.
ALTER TABLE retention ADD COLUMN kv_peaks_pruned INTEGER NOT NULL DEFAULT 0;
