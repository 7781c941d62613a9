"""Which generation runs when on a model's MLX thread: one at a time, gated by KV, or batched.

Owns the queues in front of the MLX thread: one at a time in arrival order
(:mod:`.serial`), admission that waits for the
budget's KV reservation (:mod:`.kv_gate`), continuous batching on the Trio
side (:mod:`.batching`) and its decode loop on the MLX thread
(:mod:`.batch_loop`, its deliveries in :mod:`.deliveries`, with a lone request decoded without the batch:
:mod:`.solo`), prefill chunks sized to the measured rate
(:mod:`.prefill_pace`), per-request samplers (:mod:`.sampling`), and a batched
request's own failures kept to itself (:mod:`.guard`).

May import: :mod:`mlxd.engines.base`, :mod:`mlxd.engines.injected_faults`,
:mod:`mlxd.engines.runtime`, :mod:`mlxd.engines.text` (the streamed output),
:mod:`mlxd.engines.cache`, :mod:`mlxd.config`, :mod:`mlxd.errors`; never the
engine classes, the workers, the residency or HTTP.
"""
