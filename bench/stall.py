"""Event-loop stall: how long one oversized request keeps the daemon from answering ``/health``.

A request whose checking costs CPU in proportion to its size (a huge JSON
Schema, many tools with many parameters, thousands of long embedding inputs)
must not freeze the daemon's event loop: that work runs on a worker thread
with a bound, or is refused before it starts. This measures it from outside,
as a user would see it: one ``mlxd serve`` (a child process) with the tiny
demo model and the embedding demo model (both loaded before the clock
starts); for each case a prober sends ``GET /health`` back to back on its
own connection while the oversized request is sent, and the figure is the
longest wait for one probe's answer during the request (the stall), next to
the request's own time and status. The peer is the same daemon answering the
same probes with no request in flight (the baseline row).

Cases (each ``--runs`` times, the median and the worst reported):

* ``schema``: a chat with a ``json_schema`` of ``--props`` properties (60,000: 1.8 MB);
* ``schema_checked``: ``--checked-props`` properties (10,000: 0.4 MB) in objects of
  250, a schema small enough to be checked, compiled and enforced (4 tokens);
* ``tools``: a chat with 128 tools of 400 parameters each, ``tool_choice: required``;
* ``embeddings``: 2,000 inputs of 10,000 characters each.

Run: ``.venv/bin/python bench/stall.py [--runs 3] [--props 60000] [--out FILE]``;
results go to ``bench/results/stall.md`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

import httpx
import trio

from bench.engine import machine
from bench.soak import start_daemon, wait_ready

RESULTS = REPO / "bench" / "results"


def schema_body(props: int, per_object: int | None = None) -> dict[str, Any]:
    """``props`` string properties: in one object, or in objects of ``per_object`` each."""
    def obj(n: int) -> dict[str, Any]:
        return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}

    schema = obj(props) if per_object is None else {
        "type": "object", "properties": {f"o{j}": obj(per_object) for j in range(props // per_object)}}
    return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}


def tools_body(tools: int = 128, params: int = 400) -> dict[str, Any]:
    def tool(t: int) -> dict[str, Any]:
        props = {f"a{i}": {"type": "string", "description": f"argument {i}"} for i in range(params)}
        return {"type": "function", "function": {
            "name": f"f{t}", "description": f"tool {t}",
            "parameters": {"type": "object", "properties": props}}}

    return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool(t) for t in range(tools)], "tool_choice": "required"}


def embeddings_body(inputs: int = 2000, chars: int = 10_000) -> dict[str, Any]:
    word = "lorem "
    return {"model": "bert", "input": [(word * (chars // len(word) + 1))[:chars]] * inputs}


CASES = {"schema": lambda a: ("/v1/chat/completions", schema_body(a.props)),
         "schema_checked": lambda a: ("/v1/chat/completions", schema_body(a.checked_props, 250)),
         "tools": lambda a: ("/v1/chat/completions", tools_body()),
         "embeddings": lambda a: ("/v1/embeddings", embeddings_body())}


async def probe_gaps(url: str, stop: trio.Event, gaps: list[float], failed: list[str]) -> None:
    """``GET /health`` back to back until ``stop``: each probe's round trip (a failed probe
    counts as one, its error kept, and the next goes on a new connection)."""
    while not stop.is_set():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    (await c.get("/health")).raise_for_status()
                except httpx.HTTPError as e:
                    failed.append(type(e).__name__)
                    break
                finally:
                    gaps.append(time.perf_counter() - t0)


async def one(url: str, path: str | None, body: bytes) -> dict[str, Any]:
    gaps: list[float] = []
    failed: list[str] = []
    stop = trio.Event()
    result: dict[str, Any] = {}
    async with trio.open_nursery() as n:
        n.start_soon(probe_gaps, url, stop, gaps, failed)
        await trio.sleep(0.3)  # the prober is warm
        gaps.clear()
        t0 = time.perf_counter()
        if path is None:
            await trio.sleep(1.0)
            result["status"] = "-"
        else:
            async with httpx.AsyncClient(base_url=url, timeout=300) as c:
                r = await c.post(path, content=body, headers={"Content-Type": "application/json"})
            result["status"] = r.status_code
            result["code"] = (r.json().get("error") or {}).get("code") if r.status_code >= 400 else None
        result["seconds"] = time.perf_counter() - t0
        stop.set()
    result["stall"] = max(gaps) if gaps else float("nan")
    result["probes"] = len(gaps)
    result["failed"] = len(failed)
    return result


async def drive(url: str, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:  # both models loaded first
        for name in ("tiny", "bert"):
            r = await c.post(f"/admin/models/{name}/load")
            r.raise_for_status()
    bodies = {name: make(args) for name, make in CASES.items() if name in args.cases}
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], **{k: [] for k in bodies}}
    for _ in range(args.runs):
        runs["baseline"].append(await one(url, None, b""))
        for name, (path, body) in bodies.items():
            runs[name].append(await one(url, path, json.dumps(body).encode()))
            print(name, runs[name][-1], flush=True)
    return runs


def write_config(tmp: Path) -> Path:
    import yaml

    raw = {
        "server": {"shutdown_grace_s": 5, "max_body_mb": 64},
        "journal": {"path": str(tmp / "journal.db")},
        "manager": {"memory_budget_gb": 2, "restore_on_start": False},
        "models": [{"name": "tiny", "path": str(tmp / "tiny"), "demo": "tiny",
                    "estimated_memory_gb": 0.05},
                   {"name": "bert", "path": str(tmp / "bert"), "demo": "embedding",
                    "embedding": True, "estimated_memory_gb": 0.05}],
    }
    path = tmp / "stall.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, started: str,
           box: str, sizes: dict[str, int]) -> str:
    lines = [
        "# Event-loop stall under one oversized request (`bench/stall.py`)",
        "",
        f"- date: {started}; machine: {box}",
        f"- command: `{' '.join([Path(sys.executable).name, *sys.argv])}`",
        "- stall: the longest `GET /health` round trip while the request was in flight "
        "(baseline: the same prober with no request); request: its own time and status",
        "",
        "| case | body | runs | stall median (s) | stall worst (s) | request median (s) | status "
        "| probes failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        stalls = [r["stall"] for r in rs]
        secs = [r["seconds"] for r in rs]
        status = ", ".join(sorted({f"{r['status']}" + (f" {r['code']}" if r.get("code") else "")
                                   for r in rs}))
        size = f"{sizes.get(name, 0) / 1e6:.1f} MB" if name in sizes else "-"
        lines.append(f"| {name} | {size} | {len(rs)} | {statistics.median(stalls):.3f} | "
                     f"{max(stalls):.3f} | {statistics.median(secs):.2f} | {status} | "
                     f"{sum(r['failed'] for r in rs)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--props", type=int, default=60_000)
    ap.add_argument("--checked-props", type=int, default=10_000)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", type=Path, default=RESULTS / "stall.md")
    args = ap.parse_args()
    args.cases = args.cases.split(",")
    started = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    box = machine()
    sizes = {name: len(json.dumps(make(args)[1])) for name, make in CASES.items()
             if name in args.cases}
    with tempfile.TemporaryDirectory(prefix="mlxd-stall-") as tmp_s:
        tmp = Path(tmp_s)
        config = write_config(tmp)
        with open(tmp / "daemon.log", "wb") as log:
            proc = start_daemon(config, tmp, log)
            try:
                runs = trio.run(drive, wait_ready(proc, tmp), args)
            finally:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    text = report(runs, args, started, box, sizes)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
