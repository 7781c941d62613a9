"""Residency: which models are in memory, who may use them, and who waits.

Owns the state table (:mod:`.states`), the policies (:mod:`.policy`), the
sans-IO core (:mod:`.core`, its state and moves in :mod:`.moves`, the
scheduling pass in :mod:`.scheduler`, with :mod:`.messages`, :mod:`.records`,
:mod:`.refusals`): ``step(event) -> commands``, no await, no clock, no I/O; the
plan (:mod:`.plan`: what an acquire would do, on a copy of the core) and load
progress estimates (:mod:`.progress`); and the Trio shell that carries the
commands out (:mod:`.manager`, with :mod:`.lease`, :mod:`.events`, the
per-model counts of :mod:`.stats`, the memory estimates of :mod:`.estimates` and
the read-only :mod:`.views`). The core is private to the manager: everything
else reads it through the manager's queries and the frozen snapshots of
:mod:`.records` (``ModelSnapshot``, ``ResidencySnapshot``).

May import: :mod:`mlxd.errors` and :mod:`mlxd.units` everywhere. The core
modules (states, policy, messages, records, refusals, moves, scheduler, core,
plan, progress, events, stats) import nothing else: no config, YAML, Trio,
SQLite or MLX, and no clock, thread or OS module (``lint-imports`` checks it).
The shell also imports Trio, :mod:`mlxd.config` and, of the engines, only
:mod:`mlxd.engines.base` (the protocol; ``lint-imports`` checks it).

This ``__init__`` imports nothing, so ``import mlxd.residency.core`` stays light.
"""
