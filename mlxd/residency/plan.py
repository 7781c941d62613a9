"""What acquiring a model now would do, without doing it: the residency plan.

:func:`plan` is a pure function of the core: it copies the
:class:`~mlxd.residency.core.Core` (:meth:`~mlxd.residency.core.Core.copy`), feeds the copy the very
:class:`~mlxd.residency.messages.Acquire` a request would bring, and reads
the answer off the copy: the commands for that waiter, the victims the
scheduling pass recorded with their why (:class:`~mlxd.residency.moves.Victim`),
and the model's state. The real core is never touched, and the plan cannot
drift from what an acquire does, because it *is* the acquire's decision
(``tests/property/test_plan.py`` checks both against the real step).

``action``:

* ``ready``: a lease is granted at once;
* ``load``: the model's load starts now, or is in flight and the request joins it;
* ``evict_then_load``: idle models unload first (``victims``), then the load;
* ``drain_then_load``: busy models drain (or are preempted) first;
* ``wait``: nothing moves now: the room is already on its way, or the
  available victims are protected for a while (anti-thrash), or no victim can
  help until a lease ends;
* ``fail``: refused at once (``error.code``: ``model_capacity``,
  ``model_exceeds_budget``, ``shutting_down``, ...).

With ``kv_bytes`` (what a request of N tokens asks beyond what the model's load
reserves: ``GET /admin/plan?model=X&tokens=N``), the plan is that request's: on
a ``loaded`` model the acquire is granted on the copy and the copy is then
stepped with the :class:`~mlxd.residency.messages.ReserveKV` that request
would bring (``ready`` when the bytes are free, ``evict_then_load`` /
``drain_then_load`` when victims make room for them); on a model still to load,
the copy's load is counted with those bytes added, since both must fit.

``committed_after`` is the committed bytes once the action is done (victims
gone, the model loaded); for ``wait`` and ``fail``, what is committed now.
``eta_s`` is the seconds until the model is ready counted from its measured
load time (unloads taken as instant); None when it depends on leases ending
(a drain, a wait) or the model was never measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxd.errors import ModelNotFound
from mlxd.residency.core import Core
from mlxd.residency.messages import Acquire, Command, Grant, Reject, ReserveKV, Satisfy
from mlxd.residency.moves import BUSY_REASONS, Victim, VictimReason
from mlxd.residency.policy import ContentionPolicy
from mlxd.residency.states import State

ACTIONS = ("ready", "load", "evict_then_load", "drain_then_load", "wait", "fail")


@dataclass(frozen=True, slots=True)
class Plan:
    model: str
    action: str
    victims: tuple[Victim, ...]
    error_code: str | None
    error_message: str | None
    committed_after: int
    eta_s: float | None


def plan(
    core: Core,
    model: str,
    now: float,
    *,
    contention: ContentionPolicy | None = None,
    kv_bytes: int = 0,
) -> Plan:
    """What an acquire of ``model`` at ``now`` (then, with ``kv_bytes``, that request's KV
    reservation) would do; ``core`` is left as it was."""
    if model not in core.models:
        raise ModelNotFound(model)
    sim = core.copy()
    before, after = core.models[model], sim.models[model]
    extra = 0 if before.holds_budget else max(0, kv_bytes)  # to load: weights and KV together
    if extra:
        after.spec = replace(after.spec, size_bytes=after.spec.size_bytes + extra)
    wid = max(sim.waiters, default=0) + 1  # after every waiter already queued, as a new one is
    commands = sim.step(Acquire(wid, model, "plan", now, contention=contention))
    answer = _answer(commands, wid)
    if isinstance(answer, Grant) and kv_bytes > 0 and "plan" in sim.lease_model:
        wid += 1  # the victims read next are this step's own
        answer = _answer(sim.step(ReserveKV(wid, model, "plan", kv_bytes, now)), wid)
        if answer is None:  # room is being made for the KV: the request waits for it
            victims = tuple(sim.victims)
            action = classify(False, victims)
            committed = core.committed
            if action != "wait":
                committed += kv_bytes - sum(v.bytes for v in victims)
            return Plan(model, action, victims, None, None, committed, None)
    victims = tuple(sim.victims)
    if isinstance(answer, Reject):
        e = answer.error
        return Plan(model, "fail", victims, e.code, e.message, core.committed, None)
    if answer is not None:
        return Plan(model, "ready", victims, None, None, core.committed + max(0, kv_bytes), 0.0)
    action = classify(after.state is State.LOADING and not after.load_cancelling, victims)
    committed = core.committed
    if action != "wait":
        committed -= sum(v.bytes for v in victims)
        if not before.holds_budget:
            committed += before.spec.size_bytes + extra
    return Plan(model, action, victims, None, None, committed, _eta(sim, model, action, victims))


def _answer(commands: list[Command], wid: int) -> Grant | Satisfy | Reject | None:
    return next(
        (c for c in commands if isinstance(c, Grant | Satisfy | Reject) and c.waiter_id == wid),
        None,
    )


def classify(loading: bool, victims: tuple[Victim, ...] | list[Victim]) -> str:
    """The action of a waiter neither served nor refused at once (see the module doc)."""
    if loading:
        return "load"
    if any(v.why in BUSY_REASONS for v in victims):
        return "drain_then_load"
    return "evict_then_load" if victims else "wait"


def _eta(sim: Core, model: str, action: str, victims: tuple[Victim, ...]) -> float | None:
    r = sim.models[model]
    load_s = r.spec.load_s
    if load_s is None or action == "wait":
        return None
    if action == "load":
        started = r.load_started if r.load_started is not None else sim.now
        return max(0.0, load_s - (sim.now - started))
    if action == "evict_then_load":
        return load_s
    busy = [v for v in victims if v.why in BUSY_REASONS]
    if r.preempt_at is None or any(v.why is VictimReason.DRAIN for v in busy):
        return None  # the leases decide when the room is free
    return max(0.0, r.preempt_at - sim.now) + load_s
