"""Wait for a log line: the event a test orders itself by when the code under test only logs it.

``with logged("mlxd.journal", "has not answered") as seen: ... await seen.wait()``
wakes at the record itself instead of sleeping long enough for it to have
happened. Records from other threads (the MLX thread, hypercorn's workers) set
the event through the Trio token, so it is safe whichever thread logs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import trio


class _Catch(logging.Handler):
    def __init__(self, text: str, count: int, seen: trio.Event) -> None:
        super().__init__(logging.DEBUG)
        self.text = text
        self.left = count
        self.seen = seen
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.get_ident()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text not in record.getMessage():
            return
        self.left -= 1
        if self.left:
            return
        if threading.get_ident() == self._thread:
            self.seen.set()
        else:
            self._token.run_sync_soon(self.seen.set)


@contextmanager
def logged(
    logger: str, text: str = "", level: int | None = None, *, count: int = 1
) -> Iterator[trio.Event]:
    """An event set once ``logger`` (or a child) has logged ``count`` lines containing ``text``
    while the block runs; with ``level``, the logger's level is lowered to it meanwhile so
    that the lines are made at all."""
    seen = trio.Event()
    handler = _Catch(text, count, seen)
    target = logging.getLogger(logger)
    old_level = target.level
    if level is not None and target.getEffectiveLevel() > level:
        target.setLevel(level)
    target.addHandler(handler)
    try:
        yield seen
    finally:
        target.removeHandler(handler)
        target.setLevel(old_level)
