"""Stored responses in the journal (schema v5): the records, the writer's SQL, the chain walk, retention."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from mlxd.journal import retention
from mlxd.journal.migrate import migrate, open_database
from mlxd.journal.replay import check_journal
from mlxd.journal.responses import ResponseDeleted, ResponseStored, read_chain, read_response
from mlxd.journal.rows import Item, Rejected, decode, encode, plan, prepare
from mlxd.journal.writer import Settings, Writer

from .test_retention import DAY, NOW, Fill


def stored(i: int, previous: str | None, at: float = 1.0) -> ResponseStored:
    rid = f"resp_{i}"
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"q{i}"}]}]
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"a{i}"}]}]
    response = {"id": rid, "object": "response", "output": output, "previous_response_id": previous}
    return ResponseStored(rid, at, "m", previous, "completed", json.dumps(items), json.dumps(response))


def v5(path: Path) -> sqlite3.Connection:
    conn = open_database(path, synchronous="normal")
    migrate(conn)
    conn.execute("INSERT INTO runs(id, started_at, pid, version) VALUES (1, 0, 1, 't')")
    return conn


def ids(conn: sqlite3.Connection) -> list[str]:
    return [r[0] for r in conn.execute("SELECT id FROM responses ORDER BY created_at, id")]


def test_records_round_trip_and_batch_equals_record_by_record(tmp_path: Path) -> None:
    """decode(encode(r)) == r; a batch of stored responses writes the rows the record-by-record path writes, with no events row; a deletion takes the record-by-record path."""
    records = [stored(1, None), stored(2, "resp_1", 2.0)]
    assert [decode(encode(r)) for r in records] == records
    gone = ResponseDeleted("resp_1", 3.0)
    assert decode(encode(gone)) == gone
    items: list[Item] = [(i + 1, 1, encode(r)) for i, r in enumerate(records)]
    batched, one_by_one = v5(tmp_path / "a.db"), v5(tmp_path / "b.db")
    Writer._write(batched, plan(items))
    for item in items:
        Writer._apply(one_by_one, prepare(item))
    rows = "SELECT * FROM responses ORDER BY id"
    assert batched.execute(rows).fetchall() == one_by_one.execute(rows).fetchall()
    assert ids(batched) == ["resp_1", "resp_2"]
    assert batched.execute("SELECT count(*) FROM events").fetchone() == (0,)
    with pytest.raises(Rejected):
        plan([*items, (3, 1, encode(gone))])
    Writer._apply(batched, prepare((3, 1, encode(gone))))
    Writer._apply(batched, prepare((4, 1, encode(gone))))  # a row already gone: no error
    assert ids(batched) == ["resp_2"]


def test_the_writer_commits_a_batch_with_a_deletion_and_does_not_store_a_replay_twice(tmp_path: Path) -> None:
    """A batch holding a deletion is written record by record, in order, with nothing rejected; a stored response replayed after a writer restart is not inserted twice."""
    settings = Settings(str(tmp_path / "j.db"), "normal", 1000, 0.01, 0.1, None, os.getpid())
    writer = Writer(settings, [].append)
    conn = writer._open()
    run_id = conn.execute("INSERT INTO runs(started_at, pid, version) VALUES (1, 1, 't')").lastrowid
    assert run_id is not None
    first = encode(stored(1, None))
    assert writer._commit(conn, [(1, run_id, first)]) == []
    writer._take([("replay_until", 3)], type("Inbox", (), {"closed": False})())  # type: ignore[arg-type]
    batch = [(1, run_id, first), (2, run_id, encode(stored(2, "resp_1"))),
             (3, run_id, encode(ResponseDeleted("resp_1", 5.0)))]
    assert writer._commit(conn, batch) == []
    assert ids(conn) == ["resp_2"]
    conn.close()
    writer._release_lock()


def write_chain(conn: sqlite3.Connection, length: int) -> None:
    for i in range(length):
        Writer._apply(conn, prepare((i + 1, 1, encode(stored(i, f"resp_{i - 1}" if i else None, 1.0 + i)))))


def test_the_chain_is_read_oldest_first_and_bounded(tmp_path: Path) -> None:
    """read_chain gives each response's input and output oldest first, reports a missing link, and stops at its depth and size bounds."""
    conn = v5(tmp_path / "j.db")
    write_chain(conn, 50)
    chain = read_chain(conn, "resp_49", max_depth=100, max_chars=10**9)
    assert chain is not None and not chain.cut and chain.missing is None
    texts = [(given[0]["content"][0]["text"], out[0]["content"][0]["text"]) for given, out in chain.turns]
    assert texts == [(f"q{i}", f"a{i}") for i in range(50)]
    assert read_chain(conn, "resp_nope", max_depth=100, max_chars=10**9) is None
    doc = (Path(__file__).parents[2] / "docs" / "journal.md").read_text()
    query = doc[doc.index("`WITH RECURSIVE") + 1:doc.index("FROM c;`") + 6].replace("\n", " ")
    walked = conn.execute(query.replace("'resp_...'", "'resp_49'")).fetchall()
    assert [r[0] for r in walked] == [f"resp_{i}" for i in range(49, -1, -1)]  # docs/journal.md
    cut = read_chain(conn, "resp_49", max_depth=10, max_chars=10**9)
    assert cut is not None and cut.cut
    small = read_chain(conn, "resp_49", max_depth=100, max_chars=1000)
    assert small is not None and small.cut
    conn.execute("DELETE FROM responses WHERE id = 'resp_20'")
    broken = read_chain(conn, "resp_49", max_depth=100, max_chars=10**9)
    assert broken is not None and broken.missing == "resp_20" and not broken.cut
    got = read_response(conn, "resp_49")
    assert got is not None and got["previous_response_id"] == "resp_48"


def test_retention_prunes_responses_with_the_events_of_their_time(tmp_path: Path) -> None:
    """Pruning by age removes the responses created before the pruned events' time, keeps newer ones, and counts them."""
    f = Fill(tmp_path / "j.db")
    old = NOW - 40 * DAY
    f.cycle("a", old)
    Writer._apply(f.conn, prepare((10_000, 1, encode(stored(1, None, old + 1)))))
    f.cycle("a", old + 100)
    f.cycle("a", NOW - DAY)
    Writer._apply(f.conn, prepare((10_001, 1, encode(stored(2, None, NOW - DAY + 1)))))
    assert f.prune_all(retention.Pruner(retention.Policy(retain_days=30), clock=lambda: NOW)) >= 1
    assert ids(f.conn) == ["resp_2"]
    assert f.conn.execute("SELECT responses_pruned FROM retention").fetchone() == (1,)
    assert check_journal(f.conn) == []


def test_a_stored_response_row_must_have_a_known_status(tmp_path: Path) -> None:
    """The responses table refuses a status other than completed or incomplete (a failed response is never stored)."""
    conn = v5(tmp_path / "j.db")
    bad: Any = stored(1, None)
    with pytest.raises(sqlite3.IntegrityError):
        Writer._apply(conn, prepare((1, 1, encode(ResponseStored(*[
            getattr(bad, f) if f != "status" else "failed" for f in bad.__dataclass_fields__])))))
