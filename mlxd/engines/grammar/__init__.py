"""Grammar-constrained decoding: structured output and forced tool calls, with llguidance.

Owns the logits processor built from a request's
:class:`~mlxd.engines.base.Constraint` (:mod:`.constrained`) and the check of
what a JSON Schema costs to enforce, made before its grammar is compiled
(:mod:`.schema_bounds`), so that a schema llguidance cannot enforce is a 400
instead of a stall or a crash mid-decode.

May import: :mod:`mlxd.engines.base`, :mod:`mlxd.errors`; never the
schedulers, the engines, the workers, the residency or HTTP.
"""
