"""Engines out of the daemon: ``isolation: process`` and ``distributed:`` models in worker processes.

Owns the daemon's side (:class:`~mlxd.engines.workers.process.ProcessEngine`
behind the Engine protocol, one :mod:`.worker_process` per worker and the spare
kept ready), how workers start, one or one per rank (:mod:`.launch`), the worker
process itself (:mod:`.worker`), what crosses the pipe (:mod:`.wire`), and the
text engine sharded over the ranks of an ``mlx.distributed`` group
(:mod:`.lockstep`).

May import: the engine classes (a worker hosts the model's ordinary engine),
every other subpackage of :mod:`mlxd.engines`, :mod:`mlxd.config`,
:mod:`mlxd.framing`, :mod:`mlxd.errors`, :mod:`mlxd.crash_points`; never the
residency, the journal or HTTP.
"""
