"""Residency states, the one table of legal transitions, and the journal vocabularies.

Theory of operation
-------------------
A configured model is always in exactly one residency state. The strings are
public: they appear in HTTP replies, in ``/admin/events`` and in the journal.

=============  ===============  =========  =========================================
state          memory counted   leases     meaning
=============  ===============  =========  =========================================
``unloaded``   no               no         nothing held
``loading``    yes (reserved)   no         one shared load in flight
``loaded``     yes              yes        ready
``draining``   yes              no new     chosen as victim; live leases finish or are
                                           preempted
``unloading``  yes              no         engine stop in flight
``failed``     no               no         last load failed; next acquire retries
=============  ===============  =========  =========================================

Who triggers which edge (all of them through :func:`check_transition`):

* ``unloaded -> loading``: a waiter (request, preload, admin, restore) needs the model.
* ``loading -> loaded``: the engine finished loading.
* ``loading -> failed``: the engine raised while loading (or its process died: ``engine_died``).
* ``loaded -> failed``, ``draining -> failed``: the process running the engine died
  (``isolation: process``; reason ``engine_died``); its leases end with ``error``.
* ``loading -> unloaded``: every waiter left (``abandoned``) or shutdown; the
  partial engine has been stopped before this row is written.
* ``loaded -> draining``: chosen as victim while leases are live (eviction for a
  waiter, preemption, admin unload of a busy model, shutdown).
* ``loaded -> unloading``: idle eviction, idle timeout, admin unload, shutdown.
* ``draining -> unloading``: the last lease ended.
* ``draining -> loaded``: the drain was called off (the waiter that needed the
  room gave up or got room elsewhere).
* ``unloading -> unloaded``: the engine stopped.
* ``unloading -> loaded``: the engine stop failed; the engine is kept, ``last_error`` set.
* ``failed -> loading``: the next acquire retries.
* ``failed -> unloaded``: admin unload, config reload or shutdown clears the failure.

At start-up only, a model the previous run left holding memory gets a journal
row ``<state> -> unloaded`` with reason ``crash_recovery``; that edge is legal
only with that reason (see :func:`is_legal`).

Engine stops that fail
----------------------
An engine whose ``stop()`` failed may still hold its memory, and nothing says
it still works: its bytes stay counted and it is never handed to a request
again. So the model stays in a counted state without leases until a stop
succeeds, and the table needs no new edge:

* a loaded model stays ``unloading``. The journal shows each failed stop as
  ``unloading -> loaded`` (reason ``unload_failed``, with the error) and at once
  ``loaded -> unloading`` (again ``unload_failed``); both rows come from one
  step of the core, so no lease can be granted between them;
* the partial engine of a failed or abandoned load keeps the model ``loading``
  (its waiters are refused or gone); its ``failed`` / ``unloaded`` row comes
  when a stop succeeds.

The stop is retried after :func:`mlxd.residency.policy.stop_retry_delay`
(1 s, doubling up to 5 min); an admin unload or shutdown retries at once.
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    DRAINING = "draining"
    UNLOADING = "unloading"
    FAILED = "failed"


class Reason(StrEnum):
    """Why a transition happened (the journal's ``transitions.reason``)."""

    REQUEST = "request"
    PRELOAD = "preload"
    ADMIN = "admin"
    RESTORE = "restore"
    IDLE_TIMEOUT = "idle_timeout"
    EVICTED = "evicted"
    PREEMPTED = "preempted"
    ABANDONED = "abandoned"
    LOAD_FAILED = "load_failed"
    UNLOAD_FAILED = "unload_failed"
    SHUTDOWN = "shutdown"
    CRASH_RECOVERY = "crash_recovery"
    CONFIG_RELOAD = "config_reload"
    ENGINE_DIED = "engine_died"


class Outcome(StrEnum):
    """How a lease ended (the journal's ``leases.outcome``)."""

    COMPLETED = "completed"
    ERROR = "error"
    CANCELLED = "cancelled"
    DISCONNECTED = "disconnected"
    PREEMPTED = "preempted"
    SHUTDOWN = "shutdown"
    INTERRUPTED = "interrupted"


#: The one table of legal moves. Anything not listed raises and changes nothing.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.UNLOADED: frozenset({State.LOADING}),
    State.LOADING: frozenset({State.LOADED, State.FAILED, State.UNLOADED}),
    State.LOADED: frozenset({State.DRAINING, State.UNLOADING, State.FAILED}),
    State.DRAINING: frozenset({State.UNLOADING, State.LOADED, State.FAILED}),
    State.UNLOADING: frozenset({State.UNLOADED, State.LOADED}),
    State.FAILED: frozenset({State.LOADING, State.UNLOADED}),
}

#: States whose bytes count against the memory budget.
COMMITTED: frozenset[State] = frozenset({State.LOADING, State.LOADED, State.DRAINING, State.UNLOADING})

#: States that hold (or may hold) engine memory; a crash leaves these to recover.
HOLDS_MEMORY = COMMITTED

#: States of a model holding nothing (``failed``: its load failed); a config reload may
#: remove or replace only these, and shutdown is complete when every model is in one.
DORMANT: frozenset[State] = frozenset({State.UNLOADED, State.FAILED})

#: States whose engine is up and may hold leases (``draining`` grants no new ones).
SERVING: frozenset[State] = frozenset({State.LOADED, State.DRAINING})


class IllegalTransition(Exception):
    """A move that the table does not allow; the state is left as it was."""

    def __init__(self, model: str, from_state: State, to_state: State) -> None:
        super().__init__(f"{model}: illegal residency transition {from_state} -> {to_state}")
        self.model = model
        self.from_state = from_state
        self.to_state = to_state


def is_legal(from_state: str, to_state: str, reason: str | None = None) -> bool:
    """Whether ``from_state -> to_state`` is an allowed move (journal rows included)."""
    try:
        a, b = State(from_state), State(to_state)
    except ValueError:
        return False
    if reason == Reason.CRASH_RECOVERY:
        return a in HOLDS_MEMORY and b is State.UNLOADED
    return b in TRANSITIONS[a]


#: Reasons that send a model out of memory to make room for another.
EVICTION_REASONS: frozenset[Reason] = frozenset({Reason.EVICTED, Reason.PREEMPTED})


def is_eviction(to_state: State, reason: Reason) -> bool:
    """Whether a transition is an eviction: the one definition metrics and status count.

    A model is evicted when it starts unloading to make room for another
    (``loaded -> unloading`` for an idle victim, ``draining -> unloading`` once
    a busy victim's last lease ended). Entering ``draining`` is not yet an
    eviction: the drain may be called off (``draining -> loaded``).
    """
    return to_state is State.UNLOADING and reason in EVICTION_REASONS


def check_transition(model: str, from_state: State, to_state: State) -> None:
    """Raise :class:`IllegalTransition` unless the table allows the move."""
    if to_state not in TRANSITIONS[from_state]:
        raise IllegalTransition(model, from_state, to_state)
