"""A model's files before its weights are loaded: where they come from, and what they say.

Owns source resolution and Hugging Face downloads (:mod:`.sources`), the
random-weight demo models that ``mlxd demo-model`` and the tests write
(:mod:`.demo_model`), and what a model's ``config.json``, safetensors headers
and tokenizer say about it without loading it (:mod:`.model_facts`, for
Ollama's ``/api/tags`` and ``/api/show``).

May import: :mod:`mlxd.engines.base`, :mod:`mlxd.engines.runtime` (waking
Trio from a download thread), :mod:`mlxd.engines.text` (a model's context
length and tool-call format), :mod:`mlxd.config`, :mod:`mlxd.errors`; never
the schedulers, the engines, the workers, the residency or HTTP.
"""
