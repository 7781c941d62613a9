"""The SQLite journal: every residency transition and every lease, for audit and recovery.

Owns the Trio side (:mod:`.journal`: group commit, the watermark, degraded
mode, live subscriptions in :mod:`.subscription`), the writer process
(:mod:`.writer`, which imports neither Trio nor the residency shell, so it
starts fast), the rows and recovery SQL (:mod:`.rows`), the migrations runner
(:mod:`.migrate`), the read-only queries (:mod:`.reads`) and the legality audit
(:mod:`.replay`).

May import: :mod:`mlxd.errors`, :mod:`mlxd.crash_points`, :mod:`mlxd.resources`,
:mod:`mlxd.config` (journal settings) and the residency vocabularies and
events (:mod:`mlxd.residency.states`, :mod:`mlxd.residency.events`); never the
manager, engines or HTTP. This ``__init__`` imports nothing, so the writer
process loads only what it needs.
"""
