"""`mlxd history`: journal rows as tables or JSON, read straight from the file.

It reads with a read-only connection (:func:`mlxd.journal.migrate.open_readonly`), so
it works with the daemon up or down. ``--journal PATH``, else the
``journal.path`` of ``--config``, else the default path. ``--since`` takes an
ISO time (local when it has no offset) or a duration ago (``90s``, ``15m``,
``2h``, ``7d``); ``--limit 0`` means every row. A bad ``--since`` or ``--limit``
exits 2, a missing journal file exits 1, each with one line on stderr.

``--verify`` checks the whole file instead of printing rows
(:func:`mlxd.journal.replay.check_journal`: SQLite's integrity and foreign-key
checks, an ``events`` row for each transition, every model's path legal in the
state table, no lease left open by a run that is over). It prints one line per
problem and exits 1 if there is any, 0 if the journal is sound.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from mlxd.cli.common import EXIT_FAILURE, EXIT_OK, journal_path_from_args
from mlxd.errors import ConfigError, JournalError
from mlxd.journal.migrate import open_readonly
from mlxd.journal.reads import (
    parse_since,
    read_checkpoint_rows,
    read_leases,
    read_transitions,
)
from mlxd.journal.replay import check_journal
from mlxd.units import format_bytes


def _local(at: float | None) -> str:
    if at is None:
        return "-"
    return datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def format_transitions(rows: Sequence[dict[str, Any]]) -> str:
    header = ("time", "seq", "run", "model", "transition", "reason", "memory", "error")
    body = [
        (
            _local(r["at"]),
            str(r["seq"]),
            str(r["run_id"]),
            r["model"],
            f"{r['from_state']} -> {r['to_state']}",
            r["reason"],
            format_bytes(r["memory_bytes"]),
            r["error"] or "",
        )
        for r in rows
    ]
    return _table(header, body)


def format_leases(rows: Sequence[dict[str, Any]]) -> str:
    header = ("acquired", "released", "held", "model", "outcome", "route", "client", "tokens", "lease")
    body = []
    for r in rows:
        held = (
            f"{r['released_at'] - r['acquired_at']:.2f}s"
            if r["released_at"] is not None
            else "open"
        )
        tokens = (
            f"{r['prompt_tokens'] or 0}+{r['completion_tokens'] or 0}"
            if r["prompt_tokens"] is not None or r["completion_tokens"] is not None
            else "-"
        )
        body.append(
            (
                _local(r["acquired_at"]),
                _local(r["released_at"]),
                held,
                r["model"],
                r["outcome"] or "-",
                r["route"] or "-",
                r.get("client") or "-",
                tokens,
                r["id"],
            )
        )
    return _table(header, body)


def verify(conn: sqlite3.Connection, path: str, as_json: bool) -> int:
    """``mlxd history --verify``: 0 if the journal is sound, 1 with one line per problem."""
    try:
        problems = check_journal(conn)
        (transitions,) = conn.execute("SELECT count(*) FROM transitions").fetchone()
        (runs,) = conn.execute("SELECT count(*) FROM runs").fetchone()
    except sqlite3.Error as e:
        raise JournalError(f"journal: cannot read {path}: {e}") from e
    if as_json:
        print(json.dumps({"ok": not problems, "transitions": transitions, "runs": runs,
                          "problems": problems}, indent=2))
    elif problems:
        for line in problems:
            print(f"{path}: {line}")
    else:
        print(f"{path}: sound: {transitions} transition{'' if transitions == 1 else 's'} over "
              f"{runs} run{'' if runs == 1 else 's'}, every path legal")
    return EXIT_FAILURE if problems else EXIT_OK


def cmd_history(args: argparse.Namespace) -> int:
    """``mlxd history``: print journal rows (or ``--verify`` them); reads the file, never writes."""
    if args.verify:
        path = journal_path_from_args(args)
        conn = open_readonly(Path(path))
        try:
            return verify(conn, str(path), args.json)
        finally:
            conn.close()
    since = parse_since(args.since) if args.since else None
    limit: int | None = args.limit
    if limit is not None and limit < 0:
        raise ConfigError(f"--limit: must be 0 (every row) or more, not {limit}")
    if limit == 0:
        limit = None
    path = journal_path_from_args(args)
    leases = args.leases or args.client is not None
    conn = open_readonly(Path(path))
    try:
        checkpoints = read_checkpoint_rows(conn)
        if args.checkpoints:
            rows = checkpoints
        elif leases:
            rows = read_leases(conn, model=args.model, since=since, limit=limit, client=args.client)
        else:
            rows = read_transitions(conn, model=args.model, since=since, limit=limit)
    except sqlite3.Error as e:
        raise JournalError(f"journal: cannot read {path}: {e}") from e
    finally:
        conn.close()
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no rows")
    elif args.checkpoints:
        print(format_checkpoints(rows))
    else:
        print(format_leases(rows) if leases else format_transitions(rows))
        if not leases and (notes := pruned_notes(rows, checkpoints)):
            print(notes)
    return 0


def format_checkpoints(rows: Sequence[dict[str, Any]]) -> str:
    header = ("model", "kept history starts", "at seq", "pruned at", "pruned transitions")
    body = [
        (r["model"], r["state"], str(r["seq"]), _local(r["at"]), str(r["pruned"])) for r in rows
    ]
    return _table(header, body)


def pruned_notes(rows: Sequence[dict[str, Any]], checkpoints: Sequence[dict[str, Any]]) -> str:
    """A line per model whose shown history starts where retention pruned the rows before it."""
    first: dict[str, int] = {}
    for r in rows:
        first.setdefault(r["model"], r["seq"])
    lines = [
        f"({c['model']}: {c['pruned']} earlier transitions pruned; it was {c['state']} "
        f"after seq {c['seq']} at {_local(c['at'])})"
        for c in checkpoints
        if c["model"] in first and c["seq"] < first[c["model"]]
    ]
    return "\n".join(lines)
