"""mlxd's slowest first tokens of a benchmark run, taken apart with its access log.

The benchmark sends every request with its own ``X-Request-Id`` and starts
mlxd with ``--access-log FILE --log-format json``, whose line for a request
carries that id, its arrival (``time``), ``queue_ms`` (arrival to the engine
taking the generation off its queue) and ``ttft_ms`` (arrival to the first
token handed to the response). With the client's own send time and time to
first token, a slow first token splits into four spans:

* **to mlxd**: the client's send to mlxd's arrival (connect, the request's
  bytes; the access log's ``time`` has millisecond resolution);
* **queue**: reading and checking the request, its prompt's tokens (the
  Trio thread, one request after the other), waiting for the lease and for a
  place in the running batch;
* **engine**: the engine's start to the first token reaching the response
  (prefill, the batch step it shares, the hand-over to the Trio thread);
* **to client**: the first token leaving the response to the client reading it.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

#: (client TTFT in s, request id, client send time as time.time())
Trace = tuple[float, str, float]
#: the spans of one request, in ms, in the order of COLUMNS
COLUMNS = ("client TTFT", "to mlxd", "queue", "engine", "to client")


def read_access_log(path: Path) -> dict[str, dict[str, Any]]:
    """The JSON lines of an access log, by request id (lines without one are left out)."""
    if not path.exists():
        return {}
    out: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        if "request_id" in entry:
            out[entry["request_id"]] = entry
    return out


def spans(trace: Trace, entry: dict[str, Any]) -> tuple[float, ...] | None:
    """The request's spans in ms (:data:`COLUMNS`), None when its line lacks a figure."""
    ttft, _rid, sent_at = trace
    if "ttft_ms" not in entry or "queue_ms" not in entry:
        return None
    arrived = dt.datetime.fromisoformat(entry["time"].replace("Z", "+00:00")).timestamp()
    client = ttft * 1000
    to_mlxd = max(0.0, (arrived - sent_at) * 1000)
    queue, server = float(entry["queue_ms"]), float(entry["ttft_ms"])
    return client, to_mlxd, queue, server - queue, client - to_mlxd - server


def slowest(traces: list[Trace], log: dict[str, dict[str, Any]], k: int) -> list[tuple[float, ...]]:
    """The spans of the ``k`` requests with the slowest first token that the log has."""
    out = []
    for trace in sorted(traces, reverse=True):
        entry = log.get(trace[1])
        got = spans(trace, entry) if entry is not None else None
        if got is not None:
            out.append(got)
        if len(out) == k:
            break
    return out


def render(rows: dict[int, list[tuple[float, ...]]], median: dict[int, tuple[float, ...]]) -> list[str]:
    """A markdown table: per concurrent row, its median request's spans and its slowest ones."""
    lines = [
        "mlxd's first tokens taken apart with its access log (ms; see bench/timeline.py): "
        "the median request of each concurrent row, then its slowest.",
        "",
        "| row | request | " + " | ".join(COLUMNS) + " |",
        "|---|---|" + "---:|" * len(COLUMNS),
    ]
    for n, slow in rows.items():
        named = [("median", median[n])] if n in median else []
        named += [(f"slowest {i + 1}", s) for i, s in enumerate(slow)]
        for label, figures in named:
            cells = " | ".join(f"{x:.1f}" for x in figures)
            lines.append(f"| {n} clients | {label} | {cells} |")
    lines.append("")
    return lines


def median_spans(traces: list[Trace], log: dict[str, dict[str, Any]]) -> tuple[float, ...] | None:
    """The spans of the request whose first token is the median one (that the log has)."""
    known = sorted(t for t in traces if t[1] in log)
    if not known:
        return None
    return spans(known[(len(known) - 1) // 2], log[known[(len(known) - 1) // 2][1]])
