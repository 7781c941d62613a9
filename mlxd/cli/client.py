"""``mlxd status``, ``load`` and ``unload``: the CLI side of the admin API, and how to reach it.

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

The rendering of replies is :mod:`mlxd.cli.render`; ``mlxd events``, an SSE
client, is :mod:`mlxd.cli.events`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, TextIO

import httpx

from mlxd.cli.common import DaemonUnreachable, checked_api_key
from mlxd.cli.render import load_phase, render_status, seconds
from mlxd.config import ServerConfig, load_config
from mlxd.errors import ConfigError, MlxdError
from mlxd.units import format_bytes

DEFAULT_URL = "http://127.0.0.1:8080"
#: the daemon's URL when neither --url nor --config says it (one daemon on another port)
URL_ENV = "MLXD_URL"
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


def reason_of(exc: BaseException) -> str:
    return str(exc).strip() or type(exc).__name__


def unreachable(url: str, exc: BaseException) -> DaemonUnreachable:
    """``exc`` (a connection that failed) as the CLI's one-line DaemonUnreachable."""
    reason = reason_of(exc)
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
        raise unreachable(target.url, e) from None
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        raise DaemonUnreachable(f"{target.url}: connection lost before the reply: {reason_of(e)}") from None
    except httpx.TimeoutException:
        raise RemoteError(f"no reply from {target.url} within {target.timeout:g} s") from None
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as e:
        raise ConfigError(f"--url: {reason_of(e)}") from None
    raise_for_error(resp, target)
    return resp.json()


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
