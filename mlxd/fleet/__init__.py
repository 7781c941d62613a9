"""Several daemons behind one router: mlxd's residency-aware LiteLLM routing strategy.

What it owns: the fleet file (:mod:`.config`), the routing facts each daemon
publishes in ``/admin/status`` and the pure choice made from them
(:mod:`.facts`), the status cache kept fresh in the background (:mod:`.watch`),
the strategy registered through LiteLLM's own custom-strategy hook
(:mod:`.strategy`) and the LiteLLM proxy that ``mlxd route`` starts
(:mod:`.proxy`).

It talks to the daemons over HTTP only: it imports nothing of the daemon
(residency, HTTP app, engines, journal), and nothing in mlxd but the CLI's
``route`` and ``status --fleet`` commands imports it (import-linter contracts),
so ``litellm`` (the ``mlxd[fleet]`` extra) is needed only where a router runs.
This package's ``__init__``, :mod:`.config` and :mod:`.facts` import no
``litellm``.
"""
