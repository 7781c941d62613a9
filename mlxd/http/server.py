"""The HTTP server: hypercorn's Trio worker, plus the power to close a connection.

hypercorn writes a response with a *shielded* ``send_all``: a client that
stops reading (its TCP window full) parks that write, and the task writing
it, beyond the reach of any cancellation, including hypercorn's own graceful
shutdown deadline. Only closing the socket wakes it (the write then fails
with ``ClosedResourceError``, which hypercorn handles as a disconnect).

So :func:`serve` is ``hypercorn.trio.serve`` (its ``worker_serve``, for plain
TCP listeners) with one change: every connection registers in
:class:`Connections`, by the ASGI scope's ``(server, client)`` addresses, so

* the app can close the connection of a request whose lease the manager had
  to end (:meth:`Connections.abort`), and
* shutdown closes what is still open when hypercorn's graceful timeout ends
  (idle keep-alive connections close at once: hypercorn closes them when its
  worker context is terminated).

Closing sets ``SO_LINGER`` to 0: the peer gets a reset, and the bytes queued
for a client that stopped reading are dropped rather than kept by the kernel.

The sockets may be bound and listening before :func:`serve` starts
(:func:`listen`): the daemon listens before its journal recovery, so that a
port in use fails the start before the journal is touched, and a client that
connects meanwhile waits in the kernel's backlog (no request is read before
``serve``) instead of being refused and trying again later.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.statsd import StatsdLogger
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState, LifespanState
from hypercorn.utils import parse_socket_addr, repr_socket_addr, wrap_app

log = logging.getLogger("mlxd.http.server")

Key = tuple[Any, Any]


class Connections:
    """The open HTTP connections, by ``(server address, client address)``."""

    def __init__(self) -> None:
        self._open: dict[Key, TCPServer] = {}

    def __len__(self) -> int:
        return len(self._open)

    @staticmethod
    def key_of(scope: Mapping[str, Any]) -> Key:
        """The key of the connection an ASGI request scope came on."""
        server, client = scope.get("server"), scope.get("client")
        return (tuple(server) if server else None, tuple(client) if client else None)

    def abort(self, key: Key) -> bool:
        """Close the connection ``key`` now (reset); False if it is not open."""
        conn = self._open.pop(key, None)
        if conn is None:
            return False
        _reset(conn.stream)
        return True

    def abort_all(self) -> int:
        """Close every open connection; returns how many."""
        keys = list(self._open)
        for key in keys:
            self.abort(key)
        return len(keys)

    def _add(self, key: Key, conn: TCPServer) -> None:
        self._open[key] = conn

    def _discard(self, key: Key, conn: TCPServer) -> None:
        if self._open.get(key) is conn:
            del self._open[key]


def _reset(stream: Any) -> None:
    sock = getattr(stream, "socket", None)
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # wakes a task parked in send_all/receive_some on it (ClosedResourceError)


class _TrackedTCPServer(TCPServer):
    """hypercorn's connection handler, registered in :class:`Connections` while it runs."""

    def __init__(self, connections: Connections, *args: Any) -> None:
        super().__init__(*args)
        self._connections = connections

    async def run(self) -> None:
        key: Key | None = None
        with contextlib.suppress(OSError):
            sock = self.stream.socket
            key = (
                parse_socket_addr(sock.family, sock.getsockname()),
                parse_socket_addr(sock.family, sock.getpeername()),
            )
        if key is not None:
            self._connections._add(key, self)
        try:
            await super().run()
        finally:
            if key is not None:
                self._connections._discard(key, self)


async def serve(
    app: Any,
    config: HypercornConfig,
    connections: Connections,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    sockets: list[socket.socket] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``sockets`` (listening already), else on ``config.bind`` (plain
    TCP), until ``shutdown_trigger`` returns.

    Then: stop accepting, close idle connections, give running requests
    ``config.graceful_timeout``, and close whatever is still open.
    """
    asgi = wrap_app(app, config.wsgi_max_body_size, None)
    config.set_statsd_logger_class(StatsdLogger)
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(asgi, config, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            listeners = []
            binds = []
            for sock in listen(config) if sockets is None else sockets:
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            handler = partial(
                _TrackedTCPServer,
                connections,
                asgi,
                config,
                context,
                ConnectionState(lifespan_state.copy()),
            )
            task_status.started(binds)
            async with trio.open_nursery() as accepting:
                accepting.start_soon(
                    partial(trio.serve_listeners, handler, listeners, handler_nursery=server_nursery)
                )
                await shutdown_trigger()
                accepting.cancel_scope.cancel()  # closes the listeners
            await context.terminated.set()  # idle keep-alive connections close now
            deadline = trio.current_time() + config.graceful_timeout
            server_nursery.cancel_scope.deadline = deadline
            lifespan_nursery.start_soon(_close_at, connections, deadline)
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


def listen(config: HypercornConfig) -> list[socket.socket]:
    """Bind ``config.bind`` (plain TCP) and listen; raises OSError (a port in use...)."""
    sockets = config.create_sockets().insecure_sockets
    try:
        for sock in sockets:
            sock.listen(config.backlog)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def _close_at(connections: Connections, deadline: float) -> None:
    await trio.sleep_until(deadline)
    n = connections.abort_all()
    if n:
        log.warning("closed %d connection(s) still open after the graceful timeout", n)
