"""What every MLX engine of a process shares: its MLX thread, MLX's memory, mlx-lm imported ahead.

Owns the dedicated MLX thread of an engine and the pool of idle ones
(:mod:`.mlx_thread`), what its jobs send into Trio (:mod:`.jobs`: the outbox, sinks,
a generation's job and stats), memory measurement and release (:mod:`.memory`: MLX's
counters, the device's limits, giving the heap back), and mlx-lm imported on a
background thread at start-up (:mod:`.imports_ahead`). MLX itself is imported
lazily, on the thread that uses it.

May import: :mod:`mlxd.engines.base` (the request and event shapes),
:mod:`mlxd.errors`; never another subpackage of :mod:`mlxd.engines`, the
residency, the journal or HTTP.
"""
