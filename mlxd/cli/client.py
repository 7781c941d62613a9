"""``mlxd status``, ``load``, ``unload`` and ``events``: the CLI side of the admin API.

Each command talks to a running daemon over HTTP with a synchronous ``httpx``
client. Where it goes:

- base URL: ``--url``, else ``http://<server.host>:<server.port>`` of
  ``--config`` (a wildcard bind address becomes loopback), else ``$MLXD_URL``,
  else ``http://127.0.0.1:8080``;
- API key: ``--api-key``, else the variable named by the config's
  ``server.api_key_env`` (``MLXD_API_KEY``), sent as ``Authorization: Bearer``.

How it fails (see :mod:`mlxd.cli` for the exit codes): a daemon that cannot be
reached (refused, unknown host, connect timeout, connection lost before the
reply) raises :class:`mlxd.cli.DaemonUnreachable` (exit 3); an error reply in
the OpenAI envelope becomes :class:`RemoteError`, printed as one line
``mlxd: <message> (<code>)`` (exit 1); a malformed ``--url`` or config exits 2.

``load`` and ``unload`` block until the daemon replies (it replies once the
transition is journaled) and meanwhile show progress on stderr, polled from
``/admin/status`` by a second thread. Interrupting ``load`` only stops the
waiting: an admin load is a waiter that never leaves, so the daemon finishes it.

``events`` follows the SSE stream of ``/admin/events``. When an established
stream drops (daemon restarting, read timeout past the 15 s keepalives) it
reconnects with ``Last-Event-ID`` set to the last id it printed, so nothing is
lost or repeated; it backs off between attempts and gives up with exit 3 once
``min(--timeout, 60)`` seconds pass without a connection. A daemon unreachable
at the first attempt exits 3 at once. Ctrl-C exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TextIO

import httpx

from mlxd.cli.common import DaemonUnreachable, checked_api_key
from mlxd.config import ServerConfig, load_config
from mlxd.errors import ConfigError, MlxdError
from mlxd.units import format_bytes

DEFAULT_URL = "http://127.0.0.1:8080"
#: the daemon's URL when neither --url nor --config says it (one daemon on another port)
URL_ENV = "MLXD_URL"
#: the daemon sends a keepalive comment every 15 s; three missed ones mean the stream is dead
EVENTS_READ_TIMEOUT_S = 45.0
#: reconnect delays after a dropped event stream: 0.25 s doubling up to this
RECONNECT_MAX_DELAY_S = 5.0
#: how long ``events`` keeps reconnecting at most (``--timeout`` may shorten it)
RECONNECT_WINDOW_S = 60.0
#: /admin/status polling period of the progress line
POLL_S = 0.5
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


class RemoteError(MlxdError):
    """The daemon answered with an error, or not in time; the CLI prints one line, exit 1."""


# ---- where and how to reach the daemon -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    api_key: str | None
    timeout: float
    #: where the key comes from, for a 401's hint: "--api-key" or the variable's name
    key_source: str = "MLXD_API_KEY"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, *, read_timeout: float | None = None) -> httpx.Client:
        timeout = httpx.Timeout(
            self.timeout if read_timeout is None else read_timeout,
            connect=min(self.timeout, 10.0),
        )
        return httpx.Client(base_url=self.url, headers=self.headers(), timeout=timeout)


def _url_host(host: str) -> str:
    """A bind address as a host to connect to: wildcards become loopback, IPv6 gets brackets."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _normalize_url(raw: str) -> str:
    url = raw.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--url: must be an http:// or https:// URL (got {raw!r})")
    return url


def target_of(args: argparse.Namespace) -> Target:
    """The daemon URL, API key and timeout that ``args`` select (see the module doc)."""
    server = load_config(args.config).server if args.config else ServerConfig()
    if args.url:
        url = _normalize_url(args.url)
    elif args.config:
        url = f"http://{_url_host(server.host)}:{server.port}"
    else:
        url = _normalize_url(os.environ.get(URL_ENV) or DEFAULT_URL)
    source = "--api-key" if args.api_key else server.api_key_env
    api_key = checked_api_key(args.api_key or os.environ.get(server.api_key_env) or None, source)
    if args.timeout is not None and args.timeout <= 0:
        raise ConfigError(f"--timeout: must be a positive number of seconds (got {args.timeout})")
    return Target(url, api_key, args.timeout or 600.0, source)


def _reason(exc: BaseException) -> str:
    return str(exc).strip() or type(exc).__name__


def _unreachable(url: str, exc: BaseException) -> DaemonUnreachable:
    reason = _reason(exc)
    hint = " (is `mlxd serve` running?)" if "refused" in reason.lower() else ""
    return DaemonUnreachable(f"{url}: {reason}{hint}")


def raise_for_error(resp: httpx.Response, target: Target | None = None) -> None:
    """Turn an error reply (OpenAI envelope or not) into a one-line :class:`RemoteError`.

    A 401 says how the CLI sends a key (the daemon's own message speaks HTTP headers).
    """
    if resp.status_code < 400:
        return
    try:
        err = resp.json()["error"]
        message = str(err["message"])
        code = err.get("code") or err.get("type") or resp.status_code
    except (ValueError, KeyError, TypeError):
        message = f"HTTP {resp.status_code} {resp.reason_phrase}".strip()
        code = resp.status_code
    if resp.status_code == 401 and target is not None:
        if target.api_key is None:
            message = (f"the daemon wants an API key: set ${target.key_source} "
                       "or pass --api-key")
        elif target.key_source == "--api-key":
            message = "the daemon does not know the key given with --api-key"
        else:
            message = f"the daemon does not know the key in ${target.key_source}"
    raise RemoteError(f"{message} ({code})")


def call(target: Target, method: str, path: str, **kw: Any) -> Any:
    """One request to the daemon; its JSON reply, or the typed failure of the module doc."""
    try:
        with target.client() as client:
            resp = client.request(method, path, **kw)
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        raise _unreachable(target.url, e) from None
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        raise DaemonUnreachable(f"{target.url}: connection lost before the reply: {_reason(e)}") from None
    except httpx.TimeoutException:
        raise RemoteError(f"no reply from {target.url} within {target.timeout:g} s") from None
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as e:
        raise ConfigError(f"--url: {_reason(e)}") from None
    raise_for_error(resp, target)
    return resp.json()


# ---- formatting ----------------------------------------------------------------------------


def seconds(s: float) -> str:
    """A duration for people: ``0.3 s``, ``42 s``, ``3m12s``, ``2h05m``, ``3d04h``."""
    if s < 10:
        return f"{s:.1f} s"
    if s < 60:
        return f"{s:.0f} s"
    s = int(s)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def ago(at: float | None, now: float) -> str:
    """How long ago a wall-clock time was, compactly: ``12s ago``, ``3m ago``, ``never``."""
    if at is None:
        return "never"
    s = max(0, int(now - at))
    if s < 60:
        return f"{s}s ago"
    if s < 3600:
        return f"{s // 60}m ago"
    if s < 86400:
        return f"{s // 3600}h ago"
    return f"{s // 86400}d ago"


def table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in [header, *rows]]
    return "\n".join(lines)


def load_phase(loading: dict[str, Any]) -> str:
    """A load's phase, with the download's share when it is downloading: ``downloading 40%``."""
    phase = str(loading.get("phase") or "starting")
    total = loading.get("bytes_total")
    if phase == "downloading" and total:
        phase += f" {100 * loading.get('bytes_done', 0) / total:.0f}% of {format_bytes(total)}"
    elif loading.get("percent") is not None:
        eta = loading.get("eta_s")
        phase += f" {loading['percent']}%" + ("" if eta is None else f", eta {seconds(eta)}")
    return phase


def _state_cell(m: dict[str, Any]) -> str:
    loading = m.get("loading")
    if m["state"] != "loading" or not loading:
        return str(m["state"])
    return f"loading ({seconds(loading['seconds'])}, {load_phase(loading)})"


def _policy(p: dict[str, Any]) -> str:
    parts = []
    if p.get("preempt_after_s") is not None:
        parts.append(f"preempt after {p['preempt_after_s']:g} s")
    timeout = p.get("wait_timeout_s")
    if p["strategy"] != "fail":
        parts.append("no wait timeout" if timeout is None else f"wait up to {timeout:g} s")
    return str(p["strategy"]) + (f" ({', '.join(parts)})" if parts else "")


def render_status(st: dict[str, Any], now: float) -> str:
    """``/admin/status`` as the table and summary lines ``mlxd status`` prints."""
    out = [f"mlxd {st.get('version', '?')}, up {seconds(st.get('uptime_s', 0.0))}"]
    if st.get("draining") or st.get("shutting_down"):
        out.append("SHUTTING DOWN: new requests get 503")
    if st.get("load_gate"):
        out.append(f"new loads refused: {st['load_gate']}")
    budget, committed = st["budget_bytes"], st["committed_bytes"]
    share = f" ({100 * committed / budget:.0f}%)" if budget else ""
    out.append(f"memory: {format_bytes(committed)} of {format_bytes(budget)} committed{share}; "
               f"policy {_policy(st['policy'])}")
    disk = st.get("prompt_cache_disk")
    if disk:
        out.append("prompt cache on disk: off" if not disk.get("enabled") else
                   f"prompt cache on disk: {format_bytes(disk['bytes'])} of "
                   f"{format_bytes(disk['max_bytes'])} ({disk['entries']} entries) {disk['path']}")
    out.append("")
    rows = [
        [name, _state_cell(m), "yes" if m["pinned"] else "no",
         f"{format_bytes(m['memory_bytes'])} ({m.get('memory_source') or 'unknown'})",
         str(m["active_leases"]), str(m["waiters"]), ago(m.get("last_used_at"), now),
         m.get("last_error") or "-"]
        for name, m in st["models"].items()
    ]
    header = ["MODEL", "STATE", "PINNED", "MEMORY", "LEASES", "WAITERS", "LAST USED", "LAST ERROR"]
    out.append(table(header, rows) if rows else "no models configured")
    out.append("")
    waiters = st.get("waiters", [])
    out.append(f"waiters: {len(waiters) or 'none'}")
    for w in waiters:
        deadline = "" if w.get("deadline_in_s") is None else f", gives up in {seconds(w['deadline_in_s'])}"
        blocked = ", blocked on memory" if w.get("blocked") else ""
        out.append(f"  {w['model']}  {w['kind']} ({w['reason']}) waiting {seconds(w['waiting_s'])}"
                   f"{blocked}{deadline}")
    leases = st.get("leases", [])
    out.append(f"leases: {len(leases) or 'none'}")
    for lease in leases:
        flag = "  PREEMPTED" if lease.get("preempted") else ""
        out.append(f"  {lease['model']}  {lease.get('route') or '-'}  held {seconds(lease['held_s'])}"
                   f"  request {lease.get('request_id') or '-'}  lease {lease['id']}{flag}")
    out.append(_journal_line(st.get("journal") or {}))
    return "\n".join(out)


def _journal_line(j: dict[str, Any]) -> str:
    if not j.get("enabled"):
        return "journal: disabled"
    health = "healthy" if j.get("healthy") else f"CANNOT WRITE: {j.get('last_error')}"
    return (f"journal: {health} (run {j.get('run_id')}, committed seq {j.get('committed_seq')} "
            f"of {j.get('last_seq')}) {j.get('path')}")


def format_event(seq: int | None, payload: dict[str, Any]) -> str:
    """One journal event as the line ``mlxd events`` prints."""
    at = payload.get("at")
    when = datetime.fromtimestamp(at).isoformat(sep=" ", timespec="milliseconds") if at else "-"
    head = f"{when}  #{seq if seq is not None else '-'}  {payload.get('model', '-')}  "
    kind = payload.get("kind")
    if kind == "transition":
        line = f"{payload['from_state']} -> {payload['to_state']} ({payload['reason']})"
        if payload.get("memory_bytes") is not None:
            line += f" {format_bytes(payload['memory_bytes'])}"
        if payload.get("error"):
            line += f": {payload['error']}"
        return head + line
    if kind == "lease_acquired":
        where = ", ".join(x for x in (payload.get("route"), payload.get("request_id")) if x)
        return head + "lease acquired" + (f" ({where})" if where else "")
    if kind == "lease_released":
        parts = [str(payload.get("outcome")), f"held {seconds(payload.get('held_seconds') or 0.0)}"]
        if payload.get("completion_tokens") is not None:
            parts.append(f"{payload.get('prompt_tokens') or 0}+{payload['completion_tokens']} tokens")
        return head + f"lease released ({', '.join(parts)})"
    if kind == "load_progress":
        pct, eta = payload.get("percent"), payload.get("eta_s")
        done = "" if pct is None else f" {pct}%"
        left = "" if eta is None else f", eta {seconds(eta)}"
        return head + f"loading{done} ({seconds(payload.get('elapsed_s') or 0.0)} in{left})"
    rest = {k: v for k, v in payload.items() if k not in ("kind", "model", "at")}
    return head + f"{kind} {json.dumps(rest)}"


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


# ---- progress on stderr --------------------------------------------------------------------


class Progress:
    """``loading qwen… 3.2 s (downloading 40%)`` on stderr while the main thread waits.

    On a terminal the line is redrawn in place with a spinner; otherwise a line
    is printed after 1 s and then every 10 s, so logs stay readable. The detail
    comes from ``/admin/status``, polled by this object's own thread.
    """

    def __init__(self, target: Target, verb: str, name: str, stream: TextIO | None = None) -> None:
        self.target, self.verb, self.name = target, verb, name
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.detail = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlxd-progress", daemon=True)
        self._t0 = time.monotonic()

    def __enter__(self) -> Progress:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def describe(self, st: dict[str, Any]) -> str:
        """The detail shown after the elapsed time, from one ``/admin/status`` reply."""
        m = st.get("models", {}).get(self.name)
        if m is None:
            return ""
        loading = m.get("loading")
        if m["state"] == "loading" and loading:
            return load_phase(loading)
        if m["state"] == "draining":
            return f"draining {m['active_leases']} lease(s)"
        if m["state"] in ("unloaded", "failed") and m["waiters"]:
            return "waiting for memory"
        return str(m["state"])

    def _line(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.verb} {self.name}… {seconds(time.monotonic() - self._t0)}{detail}"

    def _run(self) -> None:
        spinner = itertools.cycle(SPINNER)
        next_poll = 0.0
        next_line = 1.0  # off a terminal: a line after 1 s, then every 10 s; quick work prints none
        with self.target.client(read_timeout=2.0) as client:
            while not self._stop.wait(0.1 if self.tty else POLL_S):
                now = time.monotonic()
                if now >= next_poll:
                    next_poll = now + POLL_S
                    try:
                        resp = client.get("/admin/status")
                        if resp.status_code == 200:
                            self.detail = self.describe(resp.json())
                    except (httpx.HTTPError, ValueError):
                        pass  # progress is best effort; the main request reports failures
                if self.tty:
                    self.stream.write(f"\r\x1b[K{next(spinner)} {self._line()}")
                    self.stream.flush()
                elif now - self._t0 >= next_line:
                    print(self._line(), file=self.stream, flush=True)
                    next_line += 10.0


# ---- the commands --------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    """``mlxd status [--json]``: every model's residency, the budget, waiters, leases, journal.
    ``--fleet FILE``: every daemon of a fleet file side by side (:mod:`mlxd.cli.route`)."""
    if getattr(args, "fleet", None):
        from mlxd.cli.route import cmd_status_fleet

        return cmd_status_fleet(args)
    target = target_of(args)
    st = call(target, "GET", "/admin/status")
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print(render_status(st, time.time()))
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    """``mlxd load NAME``: make a model resident; returns once the daemon has journaled it."""
    target = target_of(args)
    t0 = time.monotonic()
    try:
        with Progress(target, "loading", args.name):
            model = call(target, "POST", f"/admin/models/{args.name}/load")
    except KeyboardInterrupt:
        print(f"mlxd: stopped waiting; the daemon keeps loading {args.name} "
              "(see `mlxd status`)", file=sys.stderr)
        return 130
    took = time.monotonic() - t0
    print(f"{args.name} {model.get('status', 'loaded')} ({format_bytes(model.get('memory_bytes'))}, "
          f"{took:.1f} s)")
    return 0


def cmd_unload(args: argparse.Namespace) -> int:
    """``mlxd unload NAME [--preempt]``: drain (or preempt) the model's leases, then unload it."""
    target = target_of(args)
    t0 = time.monotonic()
    preempt = "true" if args.preempt else "false"
    with Progress(target, "unloading", args.name):
        model = call(target, "POST", f"/admin/models/{args.name}/unload", params={"preempt": preempt})
    print(f"{args.name} {model.get('status', 'unloaded')} ({time.monotonic() - t0:.1f} s)")
    return 0


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
                    raise _unreachable(target.url, e) from None
                why = _reason(e)
            except (httpx.TransportError, httpx.DecodingError) as e:
                if not connected:
                    raise DaemonUnreachable(f"{target.url}: {_reason(e)}") from None
                why = f"connection lost: {_reason(e)}"
            now = time.monotonic()
            lost_at = now if lost_at is None else lost_at
            if now - lost_at >= window:
                raise DaemonUnreachable(
                    f"{target.url}: event stream lost after id {last_id or 'none'} ({why}); "
                    f"gave up reconnecting after {window:g} s"
                )
            time.sleep(min(delay, max(0.0, lost_at + window - now)))  # backoff, not polling
            delay = min(delay * 2, RECONNECT_MAX_DELAY_S)
