"""What a text model reads and what it streams back, with no engine and no MLX thread.

Owns the prompt (the messages through the chat template, tools included:
:mod:`.prompts`; their image parts: :mod:`.images`), how long it may be
(:mod:`.prompt_limits`, also checked by HTTP before a lease), and the output
side shared by the serial and the batched path: streaming detokenization
(:mod:`.detokenizer`), stop strings, tool calls and log probabilities
(:mod:`.streaming`, :mod:`.tool_calls`). The fake engine uses the prompt side,
so nothing here imports MLX at module level.

May import: :mod:`mlxd.engines.base`, :mod:`mlxd.engines.runtime` (a job's
outbox and stats), :mod:`mlxd.config`, :mod:`mlxd.errors`; never the
schedulers, the engines, the workers, the residency or HTTP.
"""
