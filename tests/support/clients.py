"""Hostile HTTP clients for tests: one that stops reading, one that sends slowly.

Plain blocking sockets, for tests that drive a daemon in another process.
"""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import termios
import time
from typing import Any
from urllib.parse import urlsplit


def chat_body(model: str, *, stream: bool, max_tokens: int = 100_000) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "go"}],
            "max_tokens": max_tokens, "stream": stream}


def http_request(url: str, path: str, body: dict[str, Any]) -> bytes:
    host = urlsplit(url).netloc
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


class StalledReader:
    """Starts a streaming request, reads its first bytes, then never reads again.

    Its receive buffer is small, so the daemon's writes to it soon block (its
    TCP window is full): the response body cannot be written.
    """

    def __init__(self, url: str, model: str) -> None:
        parts = urlsplit(url)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((parts.hostname or "127.0.0.1", parts.port or 80))
        self.sock.sendall(http_request(url, "/v1/chat/completions", chat_body(model, stream=True)))
        self.head = self.sock.recv(256)

    def queued(self) -> int:
        """Bytes the kernel holds for this client, unread."""
        buf = fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, struct.pack("i", 0))
        return int(struct.unpack("i", buf)[0])

    def wait_stalled(self, timeout: float = 20.0, quiet: float = 0.5) -> None:
        """Wait until no more bytes arrive for ``quiet`` seconds (the window is full)."""
        deadline = time.monotonic() + timeout
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            n = self.queued()
            if n != last:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= quiet and n > 0:
                return
            time.sleep(0.05)
        raise TimeoutError(f"the stream did not stall within {timeout} s ({last} bytes queued)")

    def closed_by_server(self, timeout: float = 5.0) -> bool:
        """Read what is queued; True if the daemon then closed (or reset) the connection."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(1 << 16):
                pass
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()
