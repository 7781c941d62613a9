"""Admin and operations routes: status, plan, load/unload, events, history, reload, health, metrics."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import trio
from quart import Blueprint, Response, request

from mlxd import __version__
from mlxd.crash_points import crash_point
from mlxd.engines.cache import prompt_disk
from mlxd.engines.text.prompt_limits import limits_for
from mlxd.errors import (
    ConfigError,
    ContextLengthExceeded,
    InvalidRequest,
    JournalError,
    ModelNotFound,
)
from mlxd.http import access_log, sse
from mlxd.http.bodies_admin import (
    AdminPlan,
    AdminStatus,
    DiskTierStatus,
    Health,
    HealthStatus,
    JournalStatus,
    Reloaded,
    plan_body,
)
from mlxd.http.bodies_openai import ModelObject
from mlxd.http.context import AppState, state
from mlxd.http.metrics import CONTENT_TYPE
from mlxd.http.openai_api import model_object
from mlxd.http.preferences import parse_contention
from mlxd.http.reload import reload_config
from mlxd.residency import views
from mlxd.residency.kv import kv_bytes_for
from mlxd.residency.plan import Plan
from mlxd.residency.states import Reason

if TYPE_CHECKING:
    from mlxd.journal.journal import Journal

log = logging.getLogger("mlxd.http")

bp = Blueprint("admin", __name__)

#: a load running longer than this many times its last measured duration (or
#: STUCK_MIN_S, whichever is larger) makes /health report ``degraded``
STUCK_FACTOR = 5.0
STUCK_MIN_S = 120.0
KEEPALIVE_S = 15.0
#: while a load is in flight, /admin/events sends a live load_progress event this often
PROGRESS_EVERY_S = 1.0


def _bool_arg(name: str) -> bool:
    # exactly the documented spellings (the OpenAPI enum): "True" or " yes" are refused, not guessed
    raw = request.args.get(name, "false")
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off", ""):
        return False
    raise InvalidRequest(
        f"{name}: must be one of true, false, 1, 0, yes, no, on, off (got {raw!r})", param=name
    )


def _int_arg(name: str, default: int, lo: int, hi: int) -> int:
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"{name}: must be an integer (got {raw!r})", param=name) from None
    if not lo <= value <= hi:
        raise InvalidRequest(f"{name}: must be between {lo} and {hi} (got {value})", param=name)
    return value


def _journal_status(st: AppState) -> JournalStatus:
    if st.journal is None:
        return {"enabled": False}
    return {
        "enabled": True,
        "path": str(st.journal.path),
        "healthy": st.journal.healthy,
        "last_error": st.journal.last_error,
        "run_id": st.journal.run_id,
        "last_seq": st.journal.last_seq,
        "committed_seq": st.journal.committed_seq,
        "rejected_rows": len(st.journal.rejected),
        "writer_pid": st.journal.writer_pid,
        "restarts": st.journal.restarts,
    }


@bp.get("/admin/status")
async def admin_status() -> AdminStatus:
    st = state()
    res = st.manager.status()
    return {
        "budget_bytes": res["budget_bytes"], "committed_bytes": res["committed_bytes"],
        "free_bytes": res["free_bytes"], "policy": res["policy"],
        "shutting_down": res["shutting_down"], "load_gate": res["load_gate"],
        "models": res["models"], "waiters": res["waiters"], "leases": res["leases"],
        "version": __version__,
        "uptime_s": round(time.time() - st.started_at, 3),
        "journal": _journal_status(st),
        "draining": st.draining,
        "prompt_cache_disk": await _disk_tier_status(st),
    }


async def _disk_tier_status(st: AppState) -> DiskTierStatus:
    """The prompt cache's disk tier: where, its bound, and what it holds (a stat walk on a thread)."""
    m = st.config.manager
    used, entries = (0, 0)
    if m.prompt_cache_disk_bytes > 0:
        used, entries = await trio.to_thread.run_sync(
            prompt_disk.tier_usage, m.prompt_cache_dir, abandon_on_cancel=True)
    return {"enabled": m.prompt_cache_disk_bytes > 0, "path": str(m.prompt_cache_dir),
            "max_bytes": m.prompt_cache_disk_bytes, "bytes": used, "entries": entries}


async def _committed() -> None:
    st = state()
    if st.journal is not None:
        await st.journal.wait_committed()


@bp.post("/admin/models/<path:model_id>/load")
async def admin_load(model_id: str) -> ModelObject:
    st = state()
    access_log.note(model=model_id)
    if not st.manager.has_model(model_id):
        raise ModelNotFound(model_id)
    # the reply describes the state the load reached (and the journal committed), even
    # if an unload slips in while it waits for the commit
    status = await st.manager.load(model_id, reason=Reason.ADMIN)
    await _committed()
    crash_point("http.after_commit_before_reply")
    return model_object(st, model_id, status)


@bp.post("/admin/models/<path:model_id>/unload")
async def admin_unload(model_id: str) -> ModelObject:
    st = state()
    access_log.note(model=model_id)
    if not st.manager.has_model(model_id):
        raise ModelNotFound(model_id)
    await st.manager.unload(model_id, preempt=_bool_arg("preempt"))
    await _committed()
    crash_point("http.after_commit_before_reply")
    return model_object(st, model_id)


@bp.get("/admin/plan")
async def admin_plan() -> AdminPlan:
    """What acquiring ``model`` now would do, computed by the core on a copy of its state."""
    st = state()
    model = request.args.get("model")
    if not model:
        raise InvalidRequest("model: required (the model to plan for)", param="model")
    if not st.manager.has_model(model):
        raise ModelNotFound(model)
    contention = parse_contention(request.args.get("contention"), "contention")
    tokens = _tokens_arg()
    mc = st.config.model(model)
    context = limits_for(mc).context if mc is not None and tokens else None
    if context is not None and tokens > context:  # the 400 such a request would get
        error = ContextLengthExceeded(
            f"model '{model}' has a context of {context:,} tokens; a request of {tokens:,} "
            "tokens exceeds it"
        )
        committed = st.manager.snapshot().committed_bytes
        return plan_body(Plan(model, "fail", (), error.code, error.message, committed, None))
    kv = kv_bytes_for(st.manager, model, tokens) if tokens else 0
    return plan_body(st.manager.plan(model, contention=contention, kv_bytes=kv))


def _tokens_arg() -> int:
    """``tokens=N``: plan for a request of N tokens (prompt + max_tokens); 0 when absent."""
    raw = request.args.get("tokens")
    if raw is None:
        return 0
    if not raw.isdigit() or not 0 < int(raw) <= MAX_PLAN_TOKENS:
        raise InvalidRequest(
            f"tokens: must be an integer from 1 to {MAX_PLAN_TOKENS:,} (got {raw!r})",
            param="tokens",
        )
    return int(raw)


#: the largest ``tokens`` a plan takes (12 digits)
MAX_PLAN_TOKENS = 999_999_999_999


#: what /admin/history lists: journal rows, or where retention's pruning left each model
HISTORY_KINDS = ("transitions", "leases", "checkpoints")
#: how long /admin/history waits for the rows recorded before it to be written; past that (a
#: stalled writer, which /health reports) it answers with the rows the file holds
HISTORY_WAIT_S = 2.0


async def _written_so_far(journal: Journal) -> None:
    """What happened before the request is in its answer: the journal writes in batches a few
    milliseconds apart, and a transition just made (a load a request waited for) may still be
    on its way to the file."""
    with trio.move_on_after(HISTORY_WAIT_S):
        try:
            await journal.wait_committed()
        except JournalError:  # a write failed or the journal closed: the file's rows are the answer
            pass


@bp.get("/admin/history")
async def admin_history() -> Any:
    st = state()
    if st.journal is None:
        raise InvalidRequest("this daemon runs without a journal")
    model = request.args.get("model") or None
    since_raw = request.args.get("since")
    since: float | None = None
    if since_raw:
        from mlxd.journal.reads import parse_since

        try:
            since = parse_since(since_raw, name="since")
        except ConfigError as e:
            raise InvalidRequest(e.message, param="since") from None
        except (ValueError, OverflowError):  # an ISO date outside what the clock can represent
            raise InvalidRequest(f"since: {since_raw[:64]!r} is out of range", param="since") from None
    limit = _int_arg("limit", 100, 1, 10_000)
    kind = request.args.get("kind", "transitions")
    if kind not in HISTORY_KINDS:
        raise InvalidRequest(f"kind: must be one of {', '.join(HISTORY_KINDS)}", param="kind")
    journal = st.journal
    await _written_so_far(journal)
    if kind == "transitions":
        rows = await trio.to_thread.run_sync(lambda: journal.history(model, since, limit))
    elif kind == "leases":
        rows = await trio.to_thread.run_sync(lambda: journal.leases(model, since, limit))
    else:
        rows = await trio.to_thread.run_sync(journal.checkpoints)
    return Response(json.dumps(rows), mimetype="application/json")


@bp.post("/admin/reload")
async def admin_reload() -> Reloaded:
    return await reload_config(state())


def health_report(st: AppState) -> Health:
    reasons: list[str] = []
    if st.journal is not None and not st.journal.healthy:
        reasons.append(f"journal cannot write: {st.journal.last_error}")
    if st.journal is not None and st.journal.rejected:
        seq, why = max(st.journal.rejected.items())
        reasons.append(
            f"journal rejected {len(st.journal.rejected)} row(s) this run, which are lost "
            f"(last: seq {seq}: {why})"
        )
    for info in st.manager.loads_in_flight():
        took = trio.current_time() - info.started
        expected = st.manager.estimates.load_seconds(info.model)
        limit = max(STUCK_MIN_S, STUCK_FACTOR * expected) if expected else STUCK_MIN_S
        if took > limit:
            reasons.append(f"load of '{info.model}' stuck for {took:.0f} s (expected < {limit:.0f} s)")
    res = st.manager.snapshot()
    if res.load_gate:
        reasons.append(f"new loads refused: {res.load_gate}")
    reasons += views.failing_stops(st.manager, res)
    reasons += views.dead_engines(st.manager, res)
    status: HealthStatus = (
        "shutting_down" if st.draining else ("degraded" if reasons else "ok"))
    return {
        "status": status,
        "ready": not st.draining and not st.restoring,
        "reasons": reasons,
        "restoring": sorted(st.restoring),
        "version": __version__,
        "uptime_s": round(time.time() - st.started_at, 3),
    }


@bp.get("/health")
async def health() -> Any:
    st = state()
    report = health_report(st)
    return Response(
        json.dumps(report), status=503 if st.draining else 200, mimetype="application/json"
    )


@bp.get("/metrics")
async def metrics() -> Any:
    st = state()
    return Response(st.metrics.render(), mimetype=None, content_type=CONTENT_TYPE)


def _sse_event(seq: int | None, payload: dict[str, Any]) -> bytes:
    """One SSE event; ``seq`` None (live, not journaled) sends no ``id:``, so resuming skips it."""
    return sse.event(payload, id=seq, name=payload.get("kind", "event"))


def _load_progress(st: AppState) -> list[bytes]:
    """A live ``load_progress`` event for each load in flight (not journaled, no id)."""
    out = []
    for info in st.manager.loads_in_flight():
        est = views.load_estimate(st.manager, info.model)
        if est is not None:
            out.append(_sse_event(None, {**est.as_dict(), "at": time.time()}))
    return out


@bp.get("/admin/events")
async def admin_events() -> Any:
    st = state()
    if st.journal is None:
        raise InvalidRequest("this daemon runs without a journal, so it has no event sequence")
    raw = request.headers.get("Last-Event-ID") or request.args.get("last_event_id") or ""
    text = raw.strip()
    # a journal sequence number: ASCII digits, small enough for SQLite's INTEGER
    if text and not (text.isascii() and text.isdigit() and len(text) <= 18):
        raise InvalidRequest(f"Last-Event-ID: must be a sequence number (got {raw[:64]!r})",
                             param="Last-Event-ID")
    last = int(text) if text else st.journal.committed_seq
    return sse.response(event_stream(st, last))


async def _backlog(st: AppState, last: int) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """Committed events after ``last`` from the journal file, in order.

    If retention pruned events after ``last``, a ``gap`` event comes first, with
    the id of the pruning watermark and every model's state there.
    """
    journal = st.journal
    assert journal is not None
    while True:
        gap, rows = await trio.to_thread.run_sync(journal.backlog, last, 1000)
        if gap is not None:
            last = gap["through"]
            yield last, gap
        for row in rows:
            last = row["seq"]
            yield last, row["payload"]
        if len(rows) < 1000:
            return


async def event_stream(st: AppState, last: int) -> AsyncIterator[bytes]:
    """Backlog from the journal after ``last``, then live events, without loss or duplicates.

    While a load is in flight, a ``load_progress`` event (no id: it is not
    journaled, and resuming skips it) goes out every ``PROGRESS_EVERY_S``.

    At shutdown the daemon cancels the waits registered in ``st.event_waits``:
    the stream then sends what the journal committed last and ends cleanly.
    """
    journal = st.journal
    assert journal is not None
    yield sse.comment("mlxd events")
    while True:
        sub = journal.subscribe()  # subscribe first, then read the backlog: nothing falls between
        try:
            async for seq, payload in _backlog(st, last):
                last = seq
                yield _sse_event(seq, payload)
            quiet_until = trio.current_time() + KEEPALIVE_S
            progress_at = trio.current_time()
            while not st.closing:
                if st.manager.loads_in_flight() and trio.current_time() >= progress_at:
                    for event in _load_progress(st):
                        yield event
                    progress_at = trio.current_time() + PROGRESS_EVERY_S
                wake = quiet_until
                if st.manager.loads_in_flight():
                    wake = min(wake, progress_at)
                with trio.move_on_at(wake) as wait:
                    st.event_waits.add(wait)
                    try:
                        seq, payload = await sub.__anext__()
                    except StopAsyncIteration:
                        break  # dropped for falling behind: resume from the journal
                    finally:
                        st.event_waits.discard(wait)
                if wait.cancelled_caught:
                    if not st.closing and trio.current_time() >= quiet_until:
                        yield sse.comment("keepalive")
                        quiet_until = trio.current_time() + KEEPALIVE_S
                    continue
                quiet_until = trio.current_time() + KEEPALIVE_S
                if seq > last:
                    last = seq
                    yield _sse_event(seq, payload)
        finally:
            sub.close()
        if st.closing:
            async for seq, payload in _backlog(st, last):
                last = seq
                yield _sse_event(seq, payload)
            return
        if not sub.dropped:
            return
