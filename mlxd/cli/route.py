"""``mlxd route`` and ``mlxd status --fleet``: several daemons behind LiteLLM's proxy.

``mlxd route --config fleet.yaml`` starts LiteLLM's own proxy server with
mlxd's residency-aware strategy (:mod:`mlxd.fleet`, the ``mlxd[fleet]`` extra)
and one deployment per daemon and model of the fleet file; ``--check`` starts
nothing: it asks every daemon's ``/admin/status`` (which loads nothing) and
prints which daemon has what, and where a request for each model would go now.
``mlxd status --fleet fleet.yaml`` prints the daemons side by side.

Exit codes (see :mod:`mlxd.cli`): 2 for a bad fleet file (or a missing
master key on a non-loopback address), 3 when a daemon does not answer
(``--check`` and ``status --fleet`` print the others first), 1 when the
``fleet`` extra is not installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from mlxd.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_UNREACHABLE
from mlxd.fleet.config import Daemon, Fleet, load_fleet
from mlxd.fleet.facts import DaemonFacts, rank
from mlxd.units import format_bytes

STATUS_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Seen:
    """One daemon's answer: its raw status, or why there is none."""

    daemon: Daemon
    status: dict[str, Any] | None
    error: str | None

    @property
    def facts(self) -> DaemonFacts | None:
        return None if self.status is None else DaemonFacts.from_status(self.daemon.name, self.status)


def ask(fleet: Fleet, timeout: float = STATUS_TIMEOUT_S) -> list[Seen]:
    """Every daemon's ``GET /admin/status``, in fleet order (never loads anything)."""
    out = []
    with httpx.Client(timeout=timeout) as client:
        for d in fleet.daemons:
            try:
                r = client.get(f"{d.url}/admin/status", headers=d.headers())
            except httpx.HTTPError as e:
                out.append(Seen(d, None, f"unreachable ({type(e).__name__})"))
                continue
            if r.status_code != 200:
                out.append(Seen(d, None, f"HTTP {r.status_code} from /admin/status "
                                         "(its key needs the read scope)"))
                continue
            try:
                status = r.json()
                DaemonFacts.from_status(d.name, status)
            except ValueError as e:  # another service at that URL: said, not a traceback
                out.append(Seen(d, None, str(e)[:200]))
                continue
            out.append(Seen(d, status, None))
    return out


def _cell(d: Daemon, facts: DaemonFacts | None, model: str) -> str:
    if model not in d.models:
        return "-"
    if facts is None:
        return "?"
    m = facts.models.get(model)
    if m is None:
        return "unknown here"
    busy = f" {m.running}r/{m.queued}q" if m.busy else ""
    return f"{m.state}{busy}"


def _room(s: Seen) -> str:
    f = s.facts
    return s.error or "?" if f is None else f"{format_bytes(f.free_bytes)} / {format_bytes(f.budget_bytes)}"


def render(fleet: Fleet, seen: list[Seen], *, routes: bool) -> str:
    """The daemons side by side: one column per daemon, one row per model; with ``routes``,
    where a request for each model would go now and why."""
    names = ["model", *(s.daemon.name for s in seen)]
    rows = [["url", *(s.daemon.url for s in seen)], ["free / budget", *map(_room, seen)]]
    for model in fleet.models():
        rows.append([model, *(_cell(s.daemon, s.facts, model) for s in seen)])
    widths = [max(len(str(r[i])) for r in [names, *rows]) for i in range(len(names))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in [names, *rows]]
    if routes:
        lines.append("")
        answering = [(s.daemon, f) for s in seen if (f := s.facts) is not None]
        for model in fleet.models():
            ranked = rank(model, [f for d, f in answering if model in d.models])
            where = (f"{ranked[0].daemon} ({ranked[0].why})" if ranked
                     else "no daemon that serves it answers")
            lines.append(f"{model}: next request goes to {where}")
    return "\n".join(lines)


def _report(fleet: Fleet, as_json: bool, *, routes: bool) -> int:
    seen = ask(fleet)
    if as_json:
        print(json.dumps({s.daemon.name: s.status if s.status is not None else {"error": s.error}
                          for s in seen}, indent=2))
    else:
        print(render(fleet, seen, routes=routes))
    down = [s for s in seen if s.error]
    for s in down:
        print(f"mlxd: {s.daemon.name} ({s.daemon.url}): {s.error}", file=sys.stderr)
    return EXIT_UNREACHABLE if down else EXIT_OK


def cmd_status_fleet(args: argparse.Namespace) -> int:
    """``mlxd status --fleet fleet.yaml``: every daemon's models side by side."""
    return _report(load_fleet(Path(args.fleet)), args.json, routes=False)


def cmd_route(args: argparse.Namespace) -> int:
    """``mlxd route --config fleet.yaml [--check]``."""
    fleet = load_fleet(Path(args.config))
    if args.check:
        return _report(fleet, False, routes=True)
    try:
        import litellm  # noqa: F401 - only to say what is missing

        from mlxd.fleet.proxy import serve
    except ImportError as e:
        print(f"mlxd: mlxd route needs the fleet extra (pip install 'mlxd[fleet]'): {e}",
              file=sys.stderr)
        return EXIT_FAILURE
    host = args.host or fleet.proxy.host
    port = fleet.proxy.port if args.port is None else args.port
    print(f"mlxd route: LiteLLM proxy on http://{host}:{port} ({args.strategy} strategy) "
          f"in front of {', '.join(d.name for d in fleet.daemons)}", file=sys.stderr)
    serve(fleet, host=host, port=port, strategy=args.strategy, log_level=args.log_level)
    return EXIT_OK
