"""``mlxd plan NAME [--json]``: what loading a model now would do, and why, without doing it.

Asks the running daemon (``GET /admin/plan?model=NAME``); the residency core
computes the answer on a copy of its state, so nothing changes. The text form::

    plan for 'big': drain_then_load: drains busy models, then loads
      small  loaded  4.00 GiB  drain: busy; its leases finish first
      committed after: 9.00 GiB of 12.00 GiB

``--contention fail`` plans for a request sent with ``X-Mlxd-Contention: fail``;
``--tokens N`` for a request of N tokens (prompt + max_tokens), whose KV beyond the
model's floor is reserved in the budget too (victims may be evicted for it).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from mlxd.cli.client import call, target_of
from mlxd.cli.render import seconds
from mlxd.units import format_bytes

#: the words for each ``why`` of a victim
WHY = {
    "idle_lru": "idle, least recently used",
    "idle_cost": "idle, cheapest to reload per byte freed",
    "drain": "busy; its leases finish first",
    "preempt": "busy; its leases are preempted (same priority)",
    "priority": "busy; its leases are preempted (lower priority)",
}

ACTION = {
    "ready": "ready now",
    "load": "loads now (or joins the load in flight)",
    "evict_then_load": "evicts idle models, then loads",
    "drain_then_load": "drains busy models, then loads",
    "wait": "waits (its room is on its way, protected for now, or held by leases)",
    "fail": "fails at once",
}


def render_plan(p: dict[str, Any], budget: int | None) -> str:
    eta = "" if p.get("eta_s") is None else f", ready in about {seconds(p['eta_s'])}"
    out = [f"plan for '{p['model']}': {p['action']}: {ACTION.get(p['action'], '')}{eta}"]
    if p.get("error"):
        out.append(f"  error: {p['error'].get('message') or ''} ({p['error']['code']})")
    for v in p.get("victims", []):
        out.append(f"  {v['model']}  {v['state']}  {format_bytes(v['bytes'])}  {v['why']}: "
                   f"{WHY.get(v['why'], '')}")
    of = "" if budget is None else f" of {format_bytes(budget)}"
    out.append(f"  committed after: {format_bytes(p['committed_after'])}{of}")
    return "\n".join(out)


def cmd_plan(args: argparse.Namespace) -> int:
    """``mlxd plan NAME [--json] [--contention S] [--tokens N]``: the plan; exit 0 whatever it says."""
    target = target_of(args)
    params = {"model": args.name}
    if args.contention:
        params["contention"] = args.contention
    if args.tokens:
        params["tokens"] = str(args.tokens)
    p = call(target, "GET", "/admin/plan", params=params)
    if args.json:
        print(json.dumps(p, indent=2))
        return 0
    budget = call(target, "GET", "/admin/status").get("budget_bytes")
    print(render_plan(p, budget))
    return 0
