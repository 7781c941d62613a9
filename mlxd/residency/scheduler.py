"""The scheduling pass of the residency core: who is served, who loads, who makes room.

Theory of operation
-------------------
After every event the core runs the pass (:meth:`Scheduler.schedule`) over
the models that have waiters, **highest priority first**, then in the order of
their earliest waiter. All waiters of a model share its fate. First every
``loaded`` model grants its waiters their leases (a model about to serve is
busy, not an idle victim); then, for each model:

* ``loading``: they join the load (single flight);
* on its way out (``draining``, ``unloading``, a failed or cancelled load
  tearing down): they wait; a late joiner starts a fresh load. Waiters whose
  policy never waits (``fail``) are refused when it is draining or its engine
  stop is stuck (a failed stop waiting for its retry);
* otherwise the model needs a load of ``need`` bytes. The pass tracks
  ``free`` (budget minus committed bytes, minus what earlier models took) and
  ``incoming`` (bytes of models already on their way out, not yet claimed;
  never a stuck stop; a drain only for waiters whose policy waits). The
  load starts when ``need <= free``; else the waiters make room
  (:meth:`Scheduler._make_room`).

Making room takes **victims** in this order, until the room suffices:

1. idle ``loaded`` models, never pinned, by the eviction rule (``lru``: least
   recently used first; ``cost``: fewest measured reload seconds per byte
   freed, LRU breaking ties); they unload at once;
2. if a waiter's policy waits: busy ``loaded`` models of **lower or equal
   priority**, never pinned, lowest priority then least recently used first;
   they drain (``draining``: no new leases). Preempting policies cancel their
   leases once the waiters' ``preempt_at`` has come.

Victims are taken in that order only until the room suffices, and a victim
taken early that the later ones make unnecessary is given back (:func:`enough`):
no model leaves for nothing.

Anti-thrash protects some victims for a while: an idle model loaded less than
``min_resident_s`` ago is no victim yet, and a model in use since the waiters
came (busy, or used after they came) keeps serving its own requests until
``max_swap_delay_s`` after they came (or after it loaded, if later), so A B A B
traffic runs as A A B B.

If the victims available now cannot make the room but will (a protected idle
model, a busy one inside its swap delay), the waiters take nothing yet and
**reserve** them, with the time to look again (``defer_until``); if no victim
can ever help, they claim nothing, so they do not block the queue behind them.
Waiters whose policy never waits (``fail``) are refused when the room is not at
hand: free bytes, bytes whose engine stop is in flight (never a drain), and idle
victims available now.

A waiter whose room is on its way keeps it: models later in the pass cannot
take it (liveness). A ``draining`` victim that no waiter claims at the end of a
pass goes back to ``loaded`` (the drain is called off), unless an admin unload
or shutdown drains it. Every victim is recorded with its why
(:class:`~mlxd.residency.moves.Victim`), which is what the plan reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxd.errors import JournalError, MlxdError
from mlxd.residency import refusals
from mlxd.residency.messages import WaiterKind
from mlxd.residency.moves import Moves, Victim, VictimReason
from mlxd.residency.records import ModelRecord
from mlxd.residency.registry import Registry
from mlxd.residency.states import DORMANT, Reason, State

#: ``reload seconds per byte`` of a model never measured: the dearest to evict
_UNKNOWN_COST = float("inf")

#: passes one step may take; reaching it means the passes do not converge (a bug)
MAX_PASSES = 16


class SchedulingDiverged(AssertionError):
    """The scheduling pass kept finding more to do: an internal error, never a user's."""


@dataclass
class _Room:
    """What one pass has left to give out."""

    free: int
    incoming: int
    #: victim on its way out -> model whose waiters claimed it
    claimed: dict[str, str] = field(default_factory=dict)
    #: loaded models a deferred waiter counts on: no one else takes them this pass
    reserved: set[str] = field(default_factory=set)


def enough(victims: list[ModelRecord], have: int, need: int) -> list[ModelRecord]:
    """The victims, in their order, that make ``have`` reach ``need``, and no more.

    They are taken in order until the room suffices; then each one taken
    before the last, the latest first, is given back if the others still make
    the room (an LRU model of 40 MB is not evicted when the 300 MB one after
    it makes the room alone). If all of them are not enough, all are taken.
    """
    chosen: list[ModelRecord] = []
    for v in victims:
        if have >= need:
            break
        chosen.append(v)
        have += v.committed_bytes
    for v in reversed(chosen[:-1]):
        if have - v.committed_bytes >= need:
            chosen.remove(v)
            have -= v.committed_bytes
    return chosen


class Scheduler:
    """The scheduling pass (see the module docstring) over the core's books, made of its moves."""

    def __init__(self, books: Registry, moves: Moves) -> None:
        self.books = books
        self.moves = moves
        #: the victims the passes of the step in progress sent out, in order
        self.victims: list[Victim] = []

    def schedule(self) -> None:
        """Pass until a pass leaves nothing for another (a fixed point).

        A drain called off turns a victim back to ``loaded``, whose waiters the next
        pass serves; KV requests left on a model that began draining are answered by
        the next pass. Passes converge: a called-off victim was claimed by nobody and
        nothing else changed in between, so the pass after is the last. More than
        :data:`MAX_PASSES` is a bug in the pass, raised as :class:`SchedulingDiverged`.
        """
        for _ in range(MAX_PASSES):
            if not self._pass():
                return
        raise SchedulingDiverged(f"the scheduling pass did not settle in {MAX_PASSES} passes")

    def _pass(self) -> bool:
        """One pass over the models with waiters; True if another is due (a drain was called
        off, or KV requests wait on a model that began draining during this one)."""
        room = _Room(
            free=self.books.budget - self.books.committed,
            incoming=sum(r.committed_bytes for r in self.books.models.values() if self._outgoing(r)),
        )
        # Loaded models serve their waiters first: a model about to grant leases is
        # busy, not an idle victim for a waiter of higher priority.
        for r in self.books.models.values():
            if r.queue and r.state is State.LOADED:
                for w in list(r.queue.values()):
                    if w.kind is not WaiterKind.KV:
                        self.moves.satisfy(w, r)
        waiting = sorted(
            (r for r in self.books.models.values() if r.queue),
            key=lambda r: (-r.priority, next(iter(r.queue))),
        )
        for r in waiting:
            self._serve(r, room)
        called_off = self._call_off_unclaimed(room.claimed)
        self._preempt_due()
        # a model drained by a later waiter of this pass left KV requests waiting on it:
        # the next pass answers them (granted from free bytes, else refused)
        kv_left = any(r.kv_waiters and r.state is State.DRAINING for r in self.books.models.values())
        return called_off or kv_left

    def _serve(self, r: ModelRecord, room: _Room) -> None:
        r.claims = []
        r.defer_until = None
        if r.kv_waiters:
            self._serve_kv(r, room)
            if r.state is State.LOADED or not r.queue:
                return
        if r.state is State.LOADING and not r.load_cancelling:
            r.blocked = False
            return
        r.blocked = True
        if r.state not in DORMANT:
            # on its way out, or a failed or cancelled load still tearing down
            if r.fail_waiters and (r.state is State.DRAINING or r.stuck):
                error = refusals.model_leaving(r.spec.name, r.state, r.retry_at, self.books.now)
                self._reject_failing(r, error)
            return
        name, need = r.spec.name, r.spec.size_bytes
        if need > self.books.budget:
            self.moves.reject_queue(r, refusals.exceeds_budget(name, need, self.books.budget))
        elif self.books.load_gate is not None:
            self.moves.reject_queue(r, JournalError(f"new loads are refused: {self.books.load_gate}"))
        elif need <= room.free:
            room.free -= need
            self.moves.start_load(r)
        else:
            self._make_room(r, need, room)

    def _serve_kv(self, r: ModelRecord, room: _Room) -> None:
        """KV asked for by requests on ``r`` (``loaded`` or ``draining``): the bytes it holds
        beyond its load's stay; room is made as for a load, never by ``r`` itself."""
        kv = [w for w in r.queue.values() if w.kind is WaiterKind.KV]
        room_max = self.books.budget - (r.committed_bytes - r.kv_bytes)  # every other model gone
        for w in kv:
            if r.kv_bytes + w.kv_bytes > room_max:
                self.moves.reject(w, refusals.kv_exceeds_budget(
                    r.spec.name, w.kv_bytes, max(0, room_max - r.kv_bytes), self.books.budget))
        kv = [w for w in kv if w.id in r.queue]
        need = sum(w.kv_bytes for w in kv)
        if not kv:
            return
        if need <= room.free:
            room.free -= need
            for w in kv:
                self.moves.grant_kv(w, r)
        elif r.state is not State.LOADED:  # draining: no victims are taken for a model leaving
            for w in kv:
                self.moves.reject(w, refusals.model_leaving(r.spec.name, r.state, None, self.books.now))
        else:
            r.blocked = True
            self._make_room(r, need, room)

    def _make_room(self, r: ModelRecord, need: int, room: _Room) -> None:
        """``r``'s waiters need ``need`` bytes more than are free: evict, drain, defer or refuse."""
        waits = r.fail_waiters < len(r.queue)
        idle, protected = self._idle_victims(r, room)
        busy, delayed = self._busy_victims(r, room) if waits else ([], [])
        idle_bytes = sum(v.committed_bytes for v in idle)
        at_hand = room.free + room.incoming + idle_bytes
        if r.fail_waiters and room.free + self._unloading(room) + idle_bytes < need:
            no_room = refusals.kv_no_room if r.kv_waiters else refusals.no_room
            self._reject_failing(r, no_room(r.spec.name, need, self.books.committed, self.books.budget))
            if not r.queue:
                return
        now_bytes = at_hand + sum(v.committed_bytes for v in busy)
        if now_bytes < need:
            later = sorted(protected + delayed, key=lambda v: self._available_at(r, v))
            if now_bytes + sum(v.committed_bytes for v in later) >= need:
                self._defer(r, need, room, idle + busy + later)
            return  # else no victim can make room now: claim nothing, touch nothing
        # a queue that never waits does not count on a drain
        have = room.free + (room.incoming if waits else self._unloading(room))
        chosen = enough(idle + busy, have, need)
        drain_reason = Reason.PREEMPTED if r.preempters else Reason.EVICTED
        for v in chosen:
            room.incoming += v.committed_bytes
            if v.leases:
                self._record_victim(v, r, self._busy_why(v, r))
                self.moves.begin_drain(v, drain_reason, owner=None, cause=self._cause(r, need))
            else:
                self._record_victim(v, r, self._idle_why())
                self.moves.begin_unload(v, Reason.EVICTED, self._cause(r, need))
        self._take(r, need, room)

    @staticmethod
    def _cause(r: ModelRecord, need: int) -> str:
        """What the victims of ``r``'s waiters go for (the journal's ``cause``)."""
        if r.kv_waiters:
            return f"KV of a request on '{r.spec.name}' ({need} bytes)"
        return f"load of '{r.spec.name}' ({need} bytes)"

    def _take(self, r: ModelRecord, need: int, room: _Room) -> int:
        """Let ``r`` take free bytes, then claim bytes on their way out; returns what is still missing."""
        take_free = min(room.free, need)
        room.free -= take_free
        rest = need - take_free
        take_in = min(room.incoming, rest)
        room.incoming -= take_in
        self._claim_outgoing(r, take_in, room.claimed)
        return rest - take_in

    def _reject_failing(self, r: ModelRecord, error: MlxdError) -> None:
        """Refuse ``r``'s waiters whose policy never waits (``fail``)."""
        for w in [w for w in r.queue.values() if not w.policy.waits]:
            self.moves.reject(w, error)

    def _defer(self, r: ModelRecord, need: int, room: _Room, candidates: list[ModelRecord]) -> None:
        """Not yet: reserve what will make the room, and look again when the next one is available."""
        missing = self._take(r, need, room)
        times = []
        for v in candidates:
            if missing <= 0:
                break
            missing -= v.committed_bytes
            room.reserved.add(v.spec.name)
            at = self._available_at(r, v)
            if at > self.books.now:
                times.append(at)
        r.defer_until = min(times) if times else None

    # -- victims ---------------------------------------------------------------------

    def _candidates(self, r: ModelRecord, room: _Room, *, busy: bool) -> list[ModelRecord]:
        return [
            v
            for name, v in self.books.models.items()
            if name != r.spec.name
            and v.state is State.LOADED
            and not v.spec.pinned
            and name not in room.reserved
            and bool(v.leases) == busy
        ]

    def _idle_victims(
        self, r: ModelRecord, room: _Room
    ) -> tuple[list[ModelRecord], list[ModelRecord]]:
        """Idle victims available now in eviction order, and those protected by min_resident_s."""
        cost = self.books.rules.eviction == "cost"

        def key(v: ModelRecord) -> tuple[float, float, str]:
            return (self._reload_cost(v) if cost else 0.0, v.last_used or 0.0, v.spec.name)

        now: list[ModelRecord] = []
        protected: list[ModelRecord] = []
        for v in sorted(self._candidates(r, room, busy=False), key=key):
            (protected if self._available_at(r, v) > self.books.now else now).append(v)
        return now, protected

    def _busy_victims(
        self, r: ModelRecord, room: _Room
    ) -> tuple[list[ModelRecord], list[ModelRecord]]:
        """Busy victims of lower or equal priority available now, and those inside their swap delay."""
        cands = sorted(
            (v for v in self._candidates(r, room, busy=True) if v.priority <= r.priority),
            key=lambda v: (v.priority, v.last_used or 0.0, v.spec.name),
        )
        now = [v for v in cands if self._available_at(r, v) <= self.books.now]
        return now, [v for v in cands if self._available_at(r, v) > self.books.now]

    def _available_at(self, r: ModelRecord, v: ModelRecord) -> float:
        """When ``v`` may become ``r``'s victim: when its anti-thrash protection ends (or now).

        An idle model loaded less than ``min_resident_s`` ago is protected until then. A
        model in use since ``r``'s waiters came (busy, or used after they came) keeps
        serving until ``max_swap_delay_s`` after they came (or after it loaded, if later).
        """
        loaded_at = v.loaded_at if v.loaded_at is not None else float("-inf")
        at = self.books.now
        if not v.leases and self.books.rules.min_resident_s:
            at = max(at, loaded_at + self.books.rules.min_resident_s)
        if self.books.rules.max_swap_delay_s:
            head = r.head
            start = max(head.since if head is not None else self.books.now, loaded_at)
            if v.leases or (v.last_used is not None and v.last_used >= start):
                at = max(at, start + self.books.rules.max_swap_delay_s)
        return at

    def _reload_cost(self, v: ModelRecord) -> float:
        """Measured reload seconds per byte freed (never measured: the dearest)."""
        if v.spec.load_s is None or v.committed_bytes <= 0:
            return _UNKNOWN_COST
        return v.spec.load_s / v.committed_bytes

    def _idle_why(self) -> VictimReason:
        return VictimReason.IDLE_COST if self.books.rules.eviction == "cost" else VictimReason.IDLE_LRU

    def _busy_why(self, v: ModelRecord, r: ModelRecord) -> VictimReason:
        if r.preempt_at is None:
            return VictimReason.DRAIN
        return VictimReason.PRIORITY if v.priority < r.priority else VictimReason.PREEMPT

    def _record_victim(self, v: ModelRecord, r: ModelRecord, why: VictimReason) -> None:
        self.victims.append(Victim(v.spec.name, v.state, v.committed_bytes, why, r.spec.name))

    # -- claims, calling off, preemption ---------------------------------------------

    def _outgoing(self, v: ModelRecord) -> bool:
        """Whether a waiter may count on ``v``'s bytes coming free (claim them)."""
        if v.stuck:
            return False  # its stop failed; not until the retry
        # A drain counts whatever the manager's policy is now: waiters queued before a reload
        # switched it to `fail` keep their own policy and wait for the drain they started.
        # A `fail` waiter never counts on one (it is held to :meth:`_unloading`).
        return v.state in (State.UNLOADING, State.DRAINING)

    def _unloading(self, room: _Room) -> int:
        """Bytes of this pass's ``incoming`` whose engine stop is in flight (never a drain):
        all a ``fail`` waiter may count on."""
        unclaimed = sum(
            v.committed_bytes
            for v in self.books.models.values()
            if v.state is State.UNLOADING and not v.stuck and v.spec.name not in room.claimed
        )
        return min(room.incoming, unclaimed)

    def _claim_outgoing(self, r: ModelRecord, rest: int, claimed: dict[str, str]) -> None:
        """Let ``r``'s waiters claim unclaimed bytes on their way out, unloading ones first
        (never a drain of higher priority than theirs: unclaimed, it is called off)."""
        if rest <= 0:
            return
        outgoing = sorted(
            (
                v
                for v in self.books.models.values()
                if self._outgoing(v)
                and v.spec.name not in claimed
                and not self._drains_upward(v, r)
            ),
            key=lambda v: (v.state is State.DRAINING, v.last_used or 0.0, v.spec.name),
        )
        for v in outgoing:
            if rest <= 0:
                break
            claimed[v.spec.name] = r.spec.name
            rest -= v.committed_bytes
            if v.state is State.DRAINING:
                r.claims.append(v.spec.name)

    @staticmethod
    def _drains_upward(v: ModelRecord, r: ModelRecord) -> bool:
        """Whether keeping ``v`` draining for ``r`` would drain a busy model of higher priority
        (a drain an admin unload or shutdown owns goes on whoever claims its room)."""
        return v.state is State.DRAINING and v.drain_owner is None and v.priority > r.priority

    def _call_off_unclaimed(self, claimed: dict[str, str]) -> bool:
        called_off = False
        for r in self.books.models.values():
            if r.state is State.DRAINING and r.drain_owner is None and r.spec.name not in claimed:
                r.preempted = False
                self.moves.move(r, State.LOADED, Reason.ABANDONED)
                called_off = True
        return called_off

    def _preempt_due(self) -> None:
        """Preempt the claimed victims of waiters whose ``preempt_at`` has come (never of higher priority)."""
        for r in self.books.models.values():
            if not r.queue or r.preempt_at is None or self.books.now < r.preempt_at:
                continue
            for name in r.claims:
                v = self.books.models[name]
                if v.state is State.DRAINING and not v.preempted and v.priority <= r.priority:
                    v.out_reason = Reason.PREEMPTED
                    self.moves.preempt(v, shutdown=False)
