"""A thinking model's output split into its reasoning and its answer, as the text streams.

A model whose vocabulary has thinking markers (``<think>`` ... ``</think>``;
the engine's ``prepare`` reports them as
:class:`~mlxd.engines.base.ThinkMarkers`) writes its reasoning between them;
when the chat template opened the block in the prompt, the output starts
inside it. :class:`ThinkingSplitter` follows the markers through the deltas
and gives ``(is_thinking, text)`` pieces without the markers; a tail that may
be the start of a marker is held back until the next delta (or :meth:`flush`)
tells, so no piece ever holds part of one. Pure: no I/O, no engine.
"""

from __future__ import annotations

from mlxd.engines.base import ThinkMarkers

Piece = tuple[bool, str]


class ThinkingSplitter:
    def __init__(self, markers: ThinkMarkers) -> None:
        self.start, self.end = markers.start, markers.end
        #: inside a thinking block now
        self.thinking = markers.open
        self._held = ""

    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` completes (markers removed)."""
        buf = self._held + text
        self._held = ""
        out: list[Piece] = []
        while buf:
            marker = self.end if self.thinking else self.start
            i = buf.find(marker)
            if i >= 0:
                if i:
                    out.append((self.thinking, buf[:i]))
                buf = buf[i + len(marker):]
                self.thinking = not self.thinking
                continue
            keep = _partial(buf, marker)
            if len(buf) > keep:
                out.append((self.thinking, buf[: len(buf) - keep]))
            self._held = buf[len(buf) - keep:] if keep else ""
            break
        return out

    def flush(self) -> list[Piece]:
        """What was held back, once no more text will come."""
        held, self._held = self._held, ""
        return [(self.thinking, held)] if held else []


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def split_whole(markers: ThinkMarkers | None, text: str) -> list[Piece]:
    """A whole output's pieces, consecutive pieces of one kind joined."""
    if markers is None:
        return [(False, text)] if text else []
    s = ThinkingSplitter(markers)
    out: list[Piece] = []
    for thinking, piece in [*s.feed(text), *s.flush()]:
        if out and out[-1][0] == thinking:
            out[-1] = (thinking, out[-1][1] + piece)
        else:
            out.append((thinking, piece))
    return out
