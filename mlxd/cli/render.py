"""How the admin API's replies read on a terminal: durations, tables, ``mlxd status``, events.

Plain functions from the JSON the daemon sends (``/admin/status``, journal events
from ``/admin/events``) to text; no I/O. :mod:`mlxd.cli.client` (``status``,
``load``, ``unload``), :mod:`mlxd.cli.events` and :mod:`mlxd.cli.plan` print
with them.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from mlxd.units import format_bytes


def seconds(s: float) -> str:
    """A duration for people: ``0.3 s``, ``42 s``, ``3m12s``, ``2h05m``, ``3d04h``."""
    if s < 10:
        return f"{s:.1f} s"
    if s < 60:
        return f"{s:.0f} s"
    s = int(s)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def ago(at: float | None, now: float) -> str:
    """How long ago a wall-clock time was, compactly: ``12s ago``, ``3m ago``, ``never``."""
    if at is None:
        return "never"
    s = max(0, int(now - at))
    if s < 60:
        return f"{s}s ago"
    if s < 3600:
        return f"{s // 60}m ago"
    if s < 86400:
        return f"{s // 3600}h ago"
    return f"{s // 86400}d ago"


def table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in [header, *rows]]
    return "\n".join(lines)


def load_phase(loading: dict[str, Any]) -> str:
    """A load's phase, with the download's share when it is downloading: ``downloading 40%``."""
    phase = str(loading.get("phase") or "starting")
    total = loading.get("bytes_total")
    if phase == "downloading" and total:
        phase += f" {100 * loading.get('bytes_done', 0) / total:.0f}% of {format_bytes(total)}"
    elif loading.get("percent") is not None:
        eta = loading.get("eta_s")
        phase += f" {loading['percent']}%" + ("" if eta is None else f", eta {seconds(eta)}")
    return phase


def _state_cell(m: dict[str, Any]) -> str:
    loading = m.get("loading")
    if m["state"] != "loading" or not loading:
        return str(m["state"])
    return f"loading ({seconds(loading['seconds'])}, {load_phase(loading)})"


def _policy(p: dict[str, Any]) -> str:
    parts = []
    if p.get("preempt_after_s") is not None:
        parts.append(f"preempt after {p['preempt_after_s']:g} s")
    timeout = p.get("wait_timeout_s")
    if p["strategy"] != "fail":
        parts.append("no wait timeout" if timeout is None else f"wait up to {timeout:g} s")
    return str(p["strategy"]) + (f" ({', '.join(parts)})" if parts else "")


def render_status(st: dict[str, Any], now: float) -> str:
    """``/admin/status`` as the table and summary lines ``mlxd status`` prints."""
    out = [f"mlxd {st.get('version', '?')}, up {seconds(st.get('uptime_s', 0.0))}"]
    if st.get("draining") or st.get("shutting_down"):
        out.append("SHUTTING DOWN: new requests get 503")
    if st.get("load_gate"):
        out.append(f"new loads refused: {st['load_gate']}")
    budget, committed = st["budget_bytes"], st["committed_bytes"]
    share = f" ({100 * committed / budget:.0f}%)" if budget else ""
    out.append(f"memory: {format_bytes(committed)} of {format_bytes(budget)} committed{share}; "
               f"policy {_policy(st['policy'])}")
    disk = st.get("prompt_cache_disk")
    if disk:
        out.append("prompt cache on disk: off" if not disk.get("enabled") else
                   f"prompt cache on disk: {format_bytes(disk['bytes'])} of "
                   f"{format_bytes(disk['max_bytes'])} ({disk['entries']} entries) {disk['path']}")
    out.append("")
    rows = [
        [name, _state_cell(m), "yes" if m["pinned"] else "no",
         f"{format_bytes(m['memory_bytes'])} ({m.get('memory_source') or 'unknown'})",
         str(m["active_leases"]), str(m["waiters"]), ago(m.get("last_used_at"), now),
         m.get("last_error") or "-"]
        for name, m in st["models"].items()
    ]
    header = ["MODEL", "STATE", "PINNED", "MEMORY", "LEASES", "WAITERS", "LAST USED", "LAST ERROR"]
    out.append(table(header, rows) if rows else "no models configured")
    out.append("")
    waiters = st.get("waiters", [])
    out.append(f"waiters: {len(waiters) or 'none'}")
    for w in waiters:
        deadline = "" if w.get("deadline_in_s") is None else f", gives up in {seconds(w['deadline_in_s'])}"
        blocked = ", blocked on memory" if w.get("blocked") else ""
        out.append(f"  {w['model']}  {w['kind']} ({w['reason']}) waiting {seconds(w['waiting_s'])}"
                   f"{blocked}{deadline}")
    leases = st.get("leases", [])
    out.append(f"leases: {len(leases) or 'none'}")
    for lease in leases:
        flag = "  PREEMPTED" if lease.get("preempted") else ""
        out.append(f"  {lease['model']}  {lease.get('route') or '-'}  held {seconds(lease['held_s'])}"
                   f"  request {lease.get('request_id') or '-'}  lease {lease['id']}{flag}")
    out.append(_journal_line(st.get("journal") or {}))
    return "\n".join(out)


def _journal_line(j: dict[str, Any]) -> str:
    if not j.get("enabled"):
        return "journal: disabled"
    health = "healthy" if j.get("healthy") else f"CANNOT WRITE: {j.get('last_error')}"
    return (f"journal: {health} (run {j.get('run_id')}, committed seq {j.get('committed_seq')} "
            f"of {j.get('last_seq')}) {j.get('path')}")


def format_event(seq: int | None, payload: dict[str, Any]) -> str:
    """One journal event as the line ``mlxd events`` prints."""
    at = payload.get("at")
    when = datetime.fromtimestamp(at).isoformat(sep=" ", timespec="milliseconds") if at else "-"
    head = f"{when}  #{seq if seq is not None else '-'}  {payload.get('model', '-')}  "
    kind = payload.get("kind")
    if kind == "transition":
        line = f"{payload['from_state']} -> {payload['to_state']} ({payload['reason']})"
        if payload.get("memory_bytes") is not None:
            line += f" {format_bytes(payload['memory_bytes'])}"
        if payload.get("error"):
            line += f": {payload['error']}"
        return head + line
    if kind == "lease_acquired":
        where = ", ".join(x for x in (payload.get("route"), payload.get("request_id")) if x)
        return head + "lease acquired" + (f" ({where})" if where else "")
    if kind == "lease_released":
        parts = [str(payload.get("outcome")), f"held {seconds(payload.get('held_seconds') or 0.0)}"]
        if payload.get("completion_tokens") is not None:
            parts.append(f"{payload.get('prompt_tokens') or 0}+{payload['completion_tokens']} tokens")
        return head + f"lease released ({', '.join(parts)})"
    if kind == "load_progress":
        pct, eta = payload.get("percent"), payload.get("eta_s")
        done = "" if pct is None else f" {pct}%"
        left = "" if eta is None else f", eta {seconds(eta)}"
        return head + f"loading{done} ({seconds(payload.get('elapsed_s') or 0.0)} in{left})"
    rest = {k: v for k, v in payload.items() if k not in ("kind", "model", "at")}
    return head + f"{kind} {json.dumps(rest)}"
