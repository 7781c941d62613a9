"""The daemon's side of stored responses: write through the journal, read what it committed.

A finished response with ``store: true`` becomes a journal record
(:class:`~mlxd.journal.responses.ResponseStored`) at once, without waiting:
the journal's group commit writes it with the leases of its time. Until the
writer confirms it, its id is *pending* here; a read of a pending id (``GET``,
``DELETE``, a ``previous_response_id``) first waits for that commit (the
watermark covers every earlier record too, so a whole pending chain is then
on disk), so a client that reads right after its response ended finds it.

Reads run on a worker thread, each on its own read-only connection
(:func:`mlxd.journal.migrate.open_readonly`), beside the writer (WAL). A
journal that cannot be read is a 503 ``journal_unavailable``; one that cannot
be written loses the stored response (logged): the answer the client already
has is not taken back.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import trio

from mlxd.errors import InvalidRequest, JournalError, ResponseNotFound
from mlxd.http.bodies_responses import ResponseObject
from mlxd.http.responses_items import MAX_ITEMS
from mlxd.journal import responses
from mlxd.journal.migrate import open_readonly
from mlxd.journal.responses import Chain, ResponseDeleted, ResponseStored

if TYPE_CHECKING:
    from mlxd.journal.journal import Journal

log = logging.getLogger("mlxd.http")

T = TypeVar("T")

#: responses in one conversation continued with previous_response_id
MAX_CHAIN = 10_000
#: the longest a read waits for its pending response's commit
COMMIT_WAIT_S = 10.0


class ResponseStore:
    """Stored responses of one daemon (see the module docstring)."""

    def __init__(self, journal: Journal | None, *, max_chars: int) -> None:
        self.journal = journal
        #: the stored text a continued conversation may hold (previous responses' input and output)
        self.max_chars = max_chars
        #: id -> journal seq of stored responses not yet known to be committed
        self._pending: dict[str, int] = {}

    # ---- writing ------------------------------------------------------------------------------

    def save(
        self, items: list[dict[str, Any]], response: ResponseObject, created_at: float
    ) -> None:
        """Keep a finished response (``response["store"]`` true), without waiting for the disk."""
        journal = self.journal
        if journal is None or not response["store"]:
            return
        record = ResponseStored(
            response["id"], created_at, response["model"], response["previous_response_id"],
            response["status"], json.dumps(items), json.dumps(response),
        )
        try:
            seq = journal.record(record)  # type: ignore[arg-type]
        except JournalError as e:
            log.warning("response %s not stored: %s", response["id"], e)
            return
        committed = journal.committed_seq
        self._pending = {k: s for k, s in self._pending.items() if s > committed}
        self._pending[response["id"]] = seq

    async def delete(self, response_id: str) -> None:
        """Remove a stored response (404 if there is none)."""
        await self._settled(response_id)
        if not await self._read(lambda c: responses.response_exists(c, response_id)):
            raise ResponseNotFound(response_id, param="response_id")
        journal = self.journal
        assert journal is not None  # _read raised otherwise
        seq = journal.record(ResponseDeleted(response_id, time.time()))  # type: ignore[arg-type]
        with trio.move_on_after(COMMIT_WAIT_S):
            await journal.wait_committed(seq)

    # ---- reading ------------------------------------------------------------------------------

    async def get(self, response_id: str) -> ResponseObject:
        """A stored response (as :meth:`save` kept it: a ``ResponseObject``'s JSON)."""
        await self._settled(response_id)
        found = await self._read(lambda c: responses.read_response(c, response_id))
        if found is None:
            raise ResponseNotFound(response_id, param="response_id")
        return cast(ResponseObject, found)

    async def history(self, previous_id: str) -> list[dict[str, Any]]:
        """The items of the conversation ending with ``previous_id``, oldest first: each
        response's input items, then its output items."""
        await self._settled(previous_id)
        chain: Chain | None = await self._read(lambda c: responses.read_chain(
            c, previous_id, max_depth=MAX_CHAIN, max_chars=self.max_chars))
        param = "previous_response_id"
        if chain is None:
            raise ResponseNotFound(previous_id, param=param)
        if chain.missing is not None:
            raise ResponseNotFound(previous_id, param=param, why=(
                f": the response before it in the conversation, '{chain.missing[:80]}', is gone "
                "(deleted, or pruned by the journal's retention)"))
        if chain.cut:
            raise InvalidRequest(
                f"{param}: the conversation is longer than mlxd continues ({MAX_CHAIN:,} responses "
                f"or {self.max_chars:,} characters, server.max_body_mb); send its items as input "
                "instead", param=param)
        items = [item for given, output in chain.turns for item in (*given, *output)]
        if len(items) > MAX_ITEMS:
            raise InvalidRequest(
                f"{param}: the conversation has {len(items):,} items; at most {MAX_ITEMS:,}",
                param=param)
        return items

    async def _settled(self, response_id: str) -> None:
        """Wait (bounded) until a pending response of this id is on disk."""
        seq = self._pending.get(response_id)
        if seq is None or self.journal is None:
            return
        with trio.move_on_after(COMMIT_WAIT_S):
            try:
                await self.journal.wait_committed(seq)
            except JournalError as e:  # not on disk: the read says what is there
                log.warning("stored response %s not committed: %s", response_id, e)
                return
            self._pending.pop(response_id, None)

    async def _read(self, query: Callable[[sqlite3.Connection], T]) -> T:
        journal = self.journal
        if journal is None:
            raise JournalError("journal: this daemon has no journal to store responses in")
        path = journal.path

        def run() -> T:
            try:
                conn = open_readonly(path)
            except sqlite3.Error as e:
                raise JournalError(f"journal: cannot read {path}: {e}") from e
            try:
                return query(conn)
            except (sqlite3.Error, ValueError) as e:  # ValueError: a row that is not JSON
                raise JournalError(f"journal: cannot read {path}: {e}") from e
            finally:
                conn.close()

        return await trio.to_thread.run_sync(run)
