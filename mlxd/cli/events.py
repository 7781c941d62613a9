"""``mlxd events``: an SSE client of ``/admin/events`` that resumes where a dropped stream ended.

``events`` follows the SSE stream of ``/admin/events``. When an established
stream drops (daemon restarting, read timeout past the 15 s keepalives) it
reconnects with ``Last-Event-ID`` set to the last id it printed, so nothing is
lost or repeated; it backs off between attempts and gives up with exit 3 once
``min(--timeout, 60)`` seconds pass without a connection. A daemon unreachable
at the first attempt exits 3 at once. Ctrl-C exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from mlxd.cli.client import Target, raise_for_error, reason_of, target_of, unreachable
from mlxd.cli.common import DaemonUnreachable
from mlxd.cli.render import format_event
from mlxd.errors import ConfigError

#: the daemon sends a keepalive comment every 15 s; three missed ones mean the stream is dead
EVENTS_READ_TIMEOUT_S = 45.0
#: reconnect delays after a dropped event stream: 0.25 s doubling up to this
RECONNECT_MAX_DELAY_S = 5.0
#: how long ``events`` keeps reconnecting at most (``--timeout`` may shorten it)
RECONNECT_WINDOW_S = 60.0


# ---- server-sent events --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SSEMessage:
    #: the last event id seen so far (SSE semantics: it carries over to messages without one)
    id: str | None
    event: str
    data: str
    #: whether this message itself had an ``id:`` line (live events such as load_progress do not)
    own_id: bool = False


def parse_sse(lines: Iterable[str]) -> Iterator[SSEMessage]:
    """Messages of an SSE stream (lines without their ends); comments and empty data are skipped."""
    event_id: str | None = None
    event = ""
    data: list[str] = []
    own_id = False
    for line in lines:
        if not line:
            if data:
                yield SSEMessage(event_id, event or "message", "\n".join(data), own_id)
            event, data, own_id = "", [], False
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            data.append(value)
        elif field == "event":
            event = value
        elif field == "id" and "\0" not in value:
            event_id, own_id = value, True


def cmd_events(args: argparse.Namespace) -> int:
    """``mlxd events [--json] [--last-event-id N]``: follow transitions and leases live."""
    target = target_of(args)
    last_id = args.last_event_id
    if last_id is not None and not last_id.strip().isdigit():
        raise ConfigError(f"--last-event-id: must be a non-negative integer (got {last_id!r})")

    def emit(seq: int | None, payload: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps({"seq": seq, **payload}), flush=True)
        else:
            print(format_event(seq, payload), flush=True)

    def connected() -> None:  # events may be minutes apart: say at once that it listens
        print(f"following events of {target.url} (Ctrl-C to stop)", file=sys.stderr, flush=True)

    try:
        follow_events(target, last_id, emit, window=min(target.timeout, RECONNECT_WINDOW_S),
                      on_connect=connected)
    except KeyboardInterrupt:
        return 0
    return 0


def follow_events(
    target: Target,
    last_id: str | None,
    emit: Callable[[int | None, dict[str, Any]], None],
    *,
    window: float,
    on_connect: Callable[[], None] = lambda: None,
) -> None:
    """Print events until interrupted, resuming after drops; raises once reconnecting fails.

    ``on_connect`` is called once, when the first stream is open.
    """
    connected = False
    delay = 0.25
    lost_at: float | None = None
    with target.client(read_timeout=EVENTS_READ_TIMEOUT_S) as client:
        while True:
            why = "the stream ended"
            try:
                headers = {"Accept": "text/event-stream"}
                if last_id is not None:
                    headers["Last-Event-ID"] = last_id
                with client.stream("GET", "/admin/events", headers=headers) as resp:
                    if resp.status_code == 503 and connected:
                        why = "the daemon is shutting down"
                    else:
                        if resp.status_code >= 400:
                            resp.read()
                            raise_for_error(resp, target)
                        if not connected and lost_at is None:
                            on_connect()
                        connected, lost_at, delay = True, None, 0.25
                        for msg in parse_sse(resp.iter_lines()):
                            if msg.id is not None:
                                last_id = msg.id
                            own = msg.own_id and msg.id is not None and msg.id.isdigit()
                            seq = int(msg.id) if own and msg.id is not None else None
                            emit(seq, json.loads(msg.data))
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                if not connected:
                    raise unreachable(target.url, e) from None
                why = reason_of(e)
            except (httpx.TransportError, httpx.DecodingError) as e:
                if not connected:
                    raise DaemonUnreachable(f"{target.url}: {reason_of(e)}") from None
                why = f"connection lost: {reason_of(e)}"
            now = time.monotonic()
            lost_at = now if lost_at is None else lost_at
            if now - lost_at >= window:
                raise DaemonUnreachable(
                    f"{target.url}: event stream lost after id {last_id or 'none'} ({why}); "
                    f"gave up reconnecting after {window:g} s"
                )
            time.sleep(min(delay, max(0.0, lost_at + window - now)))  # backoff, not polling
            delay = min(delay * 2, RECONNECT_MAX_DELAY_S)
