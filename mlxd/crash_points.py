"""Named crash points: ``MLXD_CRASH_AT`` makes the process SIGKILL itself at one of them.

The crash tests (``tests/crash/``) need to kill the daemon at moments a timer
cannot hit reliably: between a journal batch's last INSERT and its COMMIT,
after the COMMIT but before the HTTP reply, while a model loads or unloads,
between two statements of a migration. The code calls
``crash_point("journal.before_commit")`` there; the test starts ``mlxd serve``
with ``MLXD_CRASH_AT=journal.before_commit:3`` and the process sends itself
``SIGKILL`` the third time it reaches that point (``name`` alone means the
first time). Several points may be armed at once, separated by commas.
``name:N=action`` picks what happens instead of SIGKILL: ``abort`` (the C
``abort()``: SIGABRT, as an MLX assertion would), or ``stall`` (the thread that
reached it sleeps forever, answering nothing: a hung load).

The variable is read once, at import. When it is unset, a crash point costs
one lookup in an empty dict. The journal's writer process (:mod:`mlxd.journal.writer`)
inherits it and names the daemon with :func:`also_kill`: a crash point reached
there kills the daemon first, as if the daemon itself had crashed at that point.

The points (``name``: where):

* ``journal.before_commit`` / ``journal.after_commit``: around the COMMIT of a
  journal batch and of start-up recovery (:mod:`mlxd.journal.writer`, :mod:`mlxd.journal.rows`);
* ``http.after_commit_before_reply``: an admin load/unload whose journal rows are
  committed, before its reply (:mod:`mlxd.http.admin_api`);
* ``manager.mid_load``: a fake engine has loaded but the manager has not heard
  yet (the model is ``loading`` in the journal);
* ``manager.mid_unload``: a fake engine has stopped but the manager has not
  heard yet (the model is ``unloading``);
* ``journal.mid_prune``: inside a retention slice, after its first DELETE and
  before the checkpoints move (:mod:`mlxd.journal.retention`);
* ``migrate.mid_migration``: after each statement of a migration, inside its
  transaction (:mod:`mlxd.journal.migrate`);
* ``worker.load`` / ``worker.loaded`` / ``worker.token``: in an engine worker
  process (:mod:`mlxd.engines.workers.worker`): a load begins; the engine has loaded
  (its memory is held) but the daemon has not been told; each generated token
  the worker relays.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "MLXD_CRASH_AT"
ACTIONS = ("kill", "abort", "stall")


def parse_spec(spec: str) -> dict[str, tuple[int, str]]:
    """``"a:3,b=abort"`` -> ``{"a": (3, "kill"), "b": (1, "abort")}``; ValueError if malformed."""
    targets: dict[str, tuple[int, str]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        point, _, action = part.partition("=")
        name, _, count = point.partition(":")
        try:
            n = int(count) if count else 1
        except ValueError:
            n = 0
        action = action or "kill"
        if not name or n < 1 or action not in ACTIONS:
            raise ValueError(
                f"{ENV}: {part!r} is not 'name', 'name:N' with N >= 1, or either with "
                f"'={'|'.join(ACTIONS)}'"
            )
        targets[name] = (n, action)
    return targets


def parse(spec: str) -> dict[str, int]:
    """``"a:3,b"`` -> ``{"a": 3, "b": 1}``; raises ValueError on a malformed spec."""
    return {name: n for name, (n, _) in parse_spec(spec).items()}


_actions: dict[str, tuple[int, str]] = parse_spec(os.environ.get(ENV, ""))
_targets: dict[str, int] = {name: n for name, (n, _) in _actions.items()}
_reached: dict[str, int] = {}
_also: list[int] = []


def also_kill(pid: int) -> None:
    """Make a crash point in this process SIGKILL ``pid`` first (the writer process's daemon)."""
    _also.append(pid)


def crash_point(name: str) -> None:
    """SIGKILL this process if ``MLXD_CRASH_AT`` arms ``name`` and this is its Nth arrival."""
    if name not in _targets:
        return
    n = _reached[name] = _reached.get(name, 0) + 1
    if n != _targets[name]:
        return
    action = _actions[name][1]
    os.write(2, f"mlxd: crash point {name}:{n} reached, {action}\n".encode())
    if action == "stall":
        while True:
            time.sleep(3600)
    for pid in _also:
        os.kill(pid, signal.SIGKILL)
    if action == "abort":
        os.abort()
    os.kill(os.getpid(), signal.SIGKILL)
