"""`Expect: 100-continue` against the real daemon: an oversized body is refused before it is sent."""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlsplit

import trio

from tests.integration.conftest import config_of, fake
from tests.support.daemon import serving


def exchange(url: str, head: bytes, body: bytes | None) -> bytes:
    """Send ``head``, read the first answer; then ``body`` if given and read on to the end."""
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(head)
        first = s.recv(65536)
        if body is None:
            return first
        s.sendall(body)
        rest = b""
        while b"\r\n\r\n" not in first + rest or b"HTTP/1.1 2" not in first + rest:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        return first + rest


async def test_an_oversized_declared_body_gets_413_before_100_continue(tmp_path: Path) -> None:
    """A request that expects 100-continue and declares a body over max_body_mb gets 413 at once (no 100 Continue); one within the limit gets 100 Continue, then its answer."""
    config = config_of({"manager": {"memory_budget_gb": 1}, "models": [fake("a", 0.1)]}, tmp_path)
    async with serving(config, tmp_path, max_body_mb=1.0) as s:
        big = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               b"Expect: 100-continue\r\nContent-Length: 5000000\r\n\r\n")
        answer = await trio.to_thread.run_sync(exchange, s.url, big, None)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        body = b'{"model": "a", "prompt": "x", "max_tokens": 2}'
        small = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Expect: 100-continue\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        answer = await trio.to_thread.run_sync(exchange, s.url, small, body)
        assert answer.startswith(b"HTTP/1.1 100"), answer[:200]
        assert b"HTTP/1.1 200" in answer, answer[:400]
