"""Live journal events for subscribers (``/admin/events``), delivered only after commit.

A :class:`Subscription` has a bounded buffer. A subscriber that falls behind is
dropped (``dropped`` set, iteration ends after its buffered events) rather than
slowing anyone down; the SSE route then resumes from the journal file. Payloads
are built from the wire records (:func:`payload`), identical to what
:meth:`mlxd.journal.journal.Journal.events_after` reads back from the file.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

import trio

from mlxd.journal.rows import Wire
from mlxd.residency.events import LeaseAcquired, LeaseReleased, TransitionEvent

#: the wire kinds subscribers hear, with their field names (measurements, KV peaks and end_run
#: are not published)
PUBLISHED_FIELDS: dict[str, tuple[str, ...]] = {
    cls.kind: tuple(cls.__dataclass_fields__)
    for cls in (TransitionEvent, LeaseAcquired, LeaseReleased)
}


def payload_of(w: Wire) -> dict[str, Any]:
    """``event.as_dict()`` as JSON gives it back (enums as strings), from the event's wire record."""
    out: dict[str, Any] = {"kind": w[0]}
    for name, value in zip(PUBLISHED_FIELDS[w[0]], w[1:], strict=True):
        out[name] = value.value if isinstance(value, Enum) else value
    return out


class Subscription:
    """Committed journal events ``(seq, payload)`` as an async iterator; see the module doc."""

    def __init__(self, on_close: Callable[[Subscription], None], buffer: int) -> None:
        self._on_close = on_close
        self._send, self._receive = trio.open_memory_channel[tuple[int, dict[str, Any]]](buffer)
        #: True when the journal dropped this subscriber for falling behind.
        self.dropped = False
        #: the seq of the last event this iterator returned
        self.last_seq: int | None = None

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> tuple[int, dict[str, Any]]:
        try:
            seq, payload = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None
        self.last_seq = seq
        return seq, payload

    def _offer(self, seq: int, payload: dict[str, Any]) -> bool:
        """Hand over one event; False (and dropped) when the buffer is full."""
        try:
            self._send.send_nowait((seq, dict(payload)))
        except trio.WouldBlock:
            self.dropped = True
            self._send.close()
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    def close(self) -> None:
        self._on_close(self)
        self._send.close()
        self._receive.close()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Subscribers:
    """The journal's live subscriptions: each fed every committed event it publishes, in
    order; one that falls behind is dropped; all end when the journal closes."""

    def __init__(self) -> None:
        self._subs: set[Subscription] = set()

    def __bool__(self) -> bool:
        return bool(self._subs)

    def add(self, buffer: int) -> Subscription:
        sub = Subscription(self._subs.discard, buffer)
        self._subs.add(sub)
        return sub

    def publish(self, published: list[tuple[int, Wire]]) -> None:
        """Hand the committed records ``(seq, wire)`` to every subscription."""
        if not published or not self._subs:
            return  # payload dicts are built only for someone to read
        payloads = [(seq, payload_of(w)) for seq, w in published]
        for sub in list(self._subs):
            for seq, payload in payloads:
                if not sub._offer(seq, payload):
                    self._subs.discard(sub)
                    break

    def close_all(self) -> None:
        """The journal closed: every subscription's iteration ends after what it buffered."""
        for sub in list(self._subs):
            sub._send.close()
        self._subs.clear()
