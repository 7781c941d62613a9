"""A loopback HTTP proxy that records what a client sends (test support).

:class:`RecordingProxy` listens on 127.0.0.1 (port 0 by default) in a thread
of its own. Each request is kept as a :class:`Recorded` (method, path, headers,
body) and, when ``record_dir`` is set, written there as
``NNN-<method>-<path>.json``. The request is then forwarded to ``target`` (an
``http://host:port`` base; the response, streamed or whole, is relayed chunk by
chunk, and its status kept in :attr:`RecordingProxy.statuses`) or, without a
target, answered with the canned ``status`` and ``body``. ``rewrite(path,
body)`` may change a JSON body before it is forwarded (a test forcing a tool
choice the client cannot ask for); the recording keeps what the client sent.

It is how the coding agents' first requests were captured
(:mod:`tests.support.agents`): the agent CLI is pointed at the proxy, which
answers a canned error so that nothing but the recording happens, or forwards to
a real mlxd so that the whole exchange can be inspected.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "host", "content-length"}


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class RecordingProxy:
    """Records each request; forwards it to ``target`` or answers ``status``/``body``."""

    def __init__(self, *, target: str | None = None, record_dir: Path | None = None,
                 status: int = 503, body: dict[str, Any] | None = None, port: int = 0,
                 rewrite: Callable[[str, Any], Any] | None = None) -> None:
        self.target = target
        self.rewrite = rewrite
        #: ``(method, path, status)`` of each forwarded response, in the order they came
        self.statuses: list[tuple[str, str, int]] = []
        self.record_dir = record_dir
        self.status = status
        self.body = body if body is not None else {
            "type": "error", "error": {"type": "overloaded_error", "message": "recording proxy"}}
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        self._got = threading.Condition(self._lock)
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> RecordingProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def wait_for(self, n: int, timeout: float) -> list[Recorded]:
        """The first ``n`` requests, waiting up to ``timeout`` seconds for them."""
        with self._got:
            self._got.wait_for(lambda: len(self.requests) >= n, timeout=timeout)
            return list(self.requests[:n])

    def _record(self, rec: Recorded) -> None:
        with self._got:
            self.requests.append(rec)
            n = len(self.requests)
            self._got.notify_all()
        if self.record_dir is not None:
            self.record_dir.mkdir(parents=True, exist_ok=True)
            name = f"{n:03d}-{rec.method}-{rec.path.strip('/').replace('/', '_').split('?')[0]}.json"
            try:
                body: Any = json.loads(rec.body) if rec.body else None
            except ValueError:
                body = rec.body.decode("utf-8", "replace")
            (self.record_dir / name).write_text(json.dumps(
                {"method": rec.method, "path": rec.path, "headers": rec.headers, "body": body}, indent=1))

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                proxy._record(Recorded(self.command, self.path, dict(self.headers.items()), body))
                if proxy.target is None:
                    self._canned()
                else:
                    if proxy.rewrite is not None and body:
                        body = json.dumps(proxy.rewrite(self.path, json.loads(body))).encode()
                    self._forward(body)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _any

            def _canned(self) -> None:
                data = json.dumps(proxy.body).encode()
                self.send_response(proxy.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _forward(self, body: bytes) -> None:
                assert proxy.target is not None
                t = urlsplit(proxy.target)
                conn = http.client.HTTPConnection(t.hostname or "127.0.0.1", t.port or 80, timeout=900)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                with proxy._lock:
                    proxy.statuses.append((self.command, self.path, resp.status))
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while chunk := resp.read1(65536):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                conn.close()

        return Handler


@contextmanager
def recording(**kw: Any) -> Iterator[RecordingProxy]:
    """A started :class:`RecordingProxy`, closed when the block ends."""
    proxy = RecordingProxy(**kw).start()
    try:
        yield proxy
    finally:
        proxy.close()
