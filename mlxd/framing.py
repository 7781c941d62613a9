"""Length-prefixed pickled messages over a pipe: the wire of mlxd's child processes.

Both the journal's writer process (:mod:`mlxd.journal.writer`) and the engine
worker processes (:mod:`mlxd.engines.workers.worker`) talk to the daemon with these
frames: a 4-byte big-endian length, then a pickle of a tuple. Pickle is safe
here because both ends are mlxd itself (a child the daemon started); nothing
that arrives from a network is ever unpickled.
"""

from __future__ import annotations

import pickle
import struct
import sys
from pathlib import Path
from typing import Any

_HEADER = struct.Struct(">I")


def frame(message: tuple[Any, ...]) -> bytes:
    """One message as it goes down a pipe: its length, then its pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


class Frames:
    """Cuts a byte stream back into the messages :func:`frame` made."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray) -> list[tuple[Any, ...]]:
        buf = self._buffer
        buf += data
        out: list[tuple[Any, ...]] = []
        start, end = 0, len(buf)
        while end - start >= 4:
            (size,) = _HEADER.unpack_from(buf, start)
            if end - start - 4 < size:
                break
            out.append(pickle.loads(buf[start + 4 : start + 4 + size]))
            start += 4 + size
        del buf[:start]
        return out

    @property
    def partial(self) -> bool:
        """True when bytes of an unfinished message are buffered."""
        return bool(self._buffer)


def child_command(module: str) -> list[str]:
    """This interpreter running ``module.main()``, with this ``mlxd`` importable.

    The package's folder is appended to ``sys.path`` (not put first: if it is a
    site-packages folder, it must not shadow the standard library).
    """
    import mlxd

    root = str(Path(mlxd.__file__).resolve().parent.parent)
    code = f"import sys; sys.path.append(sys.argv[1]); from {module} import main; main()"
    return [sys.executable, "-c", code, root]
