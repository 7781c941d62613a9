"""Stored responses (``POST /v1/responses`` with ``store: true``): their records, SQL and reads.

A stored response is one ``responses`` row (schema v5,
``migrations/0005_responses.sql``): this request's own input items, and the
response object as ``GET /v1/responses/{id}`` returns it. The daemon writes
it like every journal row: :class:`ResponseStored` and :class:`ResponseDeleted`
are journal records (:mod:`mlxd.journal.rows` turns them into SQL in the
writer process), so they share the journal's group commit, its replay after a
writer restart and its retention (a slice that prunes the events up to time T
removes the responses created before T: :mod:`mlxd.journal.retention`).

A conversation continued with ``previous_response_id`` is a chain of rows,
each naming the one before it. :func:`read_chain` walks it in one recursive
query, newest first, and stops at a depth or a total size, so a chain of any
length costs one bounded statement; the caller refuses a chain that was cut.

Nothing here imports Trio: the writer process imports this module.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

INSERT_RESPONSE = (
    "INSERT INTO responses(id, run_id, created_at, model, previous_response_id, status, input,"
    " response) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
DELETE_RESPONSE = "DELETE FROM responses WHERE id = ?"
#: a replayed record (after the writer died) that the dead writer had written: by (id, created_at)
STORED_ALREADY = "SELECT 1 FROM responses WHERE id = ? AND created_at = ? LIMIT 1"
#: retention: the responses created before the time of the last event a slice prunes
PRUNE_RESPONSES = "DELETE FROM responses WHERE created_at < :at"


@dataclass(frozen=True, slots=True)
class ResponseStored:
    """A response to keep: ``input`` and ``response`` are JSON text (see the migration)."""

    id: str
    created_at: float
    model: str
    previous_response_id: str | None
    status: str
    input: str
    response: str

    kind = "response_stored"


@dataclass(frozen=True, slots=True)
class ResponseDeleted:
    """``DELETE /v1/responses/{id}``: the row goes (deleting a row already gone changes nothing)."""

    id: str
    at: float

    kind = "response_deleted"


STORED = ResponseStored.kind
DELETED = ResponseDeleted.kind


def stored_row(run_id: int, w: tuple[Any, ...]) -> tuple[Any, ...]:
    """The ``responses`` row of a :class:`ResponseStored` wire record (its kind, then its fields)."""
    _, rid, created_at, model, previous, status, items, response = w
    return (rid, run_id, created_at, model, previous, status, items, response)


def deleted_row(w: tuple[Any, ...]) -> tuple[Any, ...]:
    return (w[1],)


# ---- reads (read-only connections, from the daemon's worker threads) -----------------------------


def read_response(conn: sqlite3.Connection, response_id: str) -> dict[str, Any] | None:
    """The stored response object, or None (never stored, deleted, pruned)."""
    row = conn.execute("SELECT response FROM responses WHERE id = ?", (response_id,)).fetchone()
    return None if row is None else dict(json.loads(row[0]))


def response_exists(conn: sqlite3.Connection, response_id: str) -> bool:
    return conn.execute("SELECT 1 FROM responses WHERE id = ?", (response_id,)).fetchone() is not None


@dataclass(frozen=True, slots=True)
class Chain:
    """What :func:`read_chain` found, oldest response first."""

    #: per response, oldest first: (its input items, its output items)
    turns: tuple[tuple[list[Any], list[Any]], ...]
    #: the id the walk could not find (deleted or pruned), or None
    missing: str | None = None
    #: the walk stopped at its depth or size bound with more responses before it
    cut: bool = False


_CHAIN = """
WITH RECURSIVE chain(id, prev, depth, size) AS (
    SELECT id, previous_response_id, 1, length(input) + length(response)
    FROM responses WHERE id = :id
    UNION ALL
    SELECT r.id, r.previous_response_id, c.depth + 1, c.size + length(r.input) + length(r.response)
    FROM responses r JOIN chain c ON r.id = c.prev
    WHERE c.depth < :depth AND c.size <= :size
)
SELECT c.depth, c.prev, c.size, r.input, r.response
FROM chain c JOIN responses r ON r.id = c.id
ORDER BY c.depth DESC
"""


def read_chain(
    conn: sqlite3.Connection, response_id: str, *, max_depth: int, max_chars: int
) -> Chain | None:
    """The conversation ending with ``response_id`` (None when that one is not stored).

    One statement, so one snapshot: a response deleted meanwhile is either
    wholly in the chain or missing from it. The walk stops after
    ``max_depth`` responses or once their stored text passes ``max_chars``
    (``cut``); a response whose predecessor is gone gives ``missing``.
    """
    rows = conn.execute(_CHAIN, {"id": response_id, "depth": max_depth, "size": max_chars}).fetchall()
    if not rows:
        return None
    depth, prev, size = rows[0][0], rows[0][1], rows[0][2]  # the oldest reached
    cut = prev is not None and (depth >= max_depth or size > max_chars)
    missing = prev if prev is not None and not cut else None
    if cut or missing is not None:
        return Chain((), missing=missing, cut=cut)  # refused: nothing to parse
    turns = tuple(
        (list(json.loads(items)), list(json.loads(response).get("output", [])))
        for _, _, _, items, response in rows
    )
    return Chain(turns, missing=missing, cut=cut)
