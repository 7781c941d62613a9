"""Soak: mixed traffic against one ``mlxd serve`` for a long time, sampling what could leak.

The daemon runs as a child process (``python -m mlxd serve``) with three
models and a budget that fits one of them: two fake engines and, unless
``--no-mlx``, the tiny MLX demo model (real mlx-lm loads, generations and
unloads). The strategy is ``wait_then_preempt``, so swaps drain, wait and
preempt. ``--clients`` workers send, back to back, a mix of:

* streams read to their end, and streams the client drops after a few chunks;
* plain chat completions;
* requests to a cold model that the client gives up on while it waits or loads;
* admin unloads (with and without ``preempt``) and ``/admin/status`` reads.

Every ``--interval`` seconds (a minute by default) it samples the daemon:
RSS, open file descriptors, threads, the journal's size (file + WAL), the
leases open at that moment, and the latency (p50/p99) and outcomes of the
requests that ended in that window. At the end it sends SIGTERM and reads the
journal: leases left open, ``clean_stop``, whether the history is legal.

Verdict (issue 10): after the warm-up (``--warmup`` minutes) RSS grows less
than 1 MB per minute (least-squares slope), open fds and threads do not
grow (the highest of five samples at each end), no lease leaks, and no 5xx
but typed 503s (``capacity_timeout``,
``preempted``, ``model_capacity``, ``overloaded``, ``shutting_down``).

Run: ``.venv/bin/python bench/soak.py [--minutes 30] [--interval 60]
[--clients 6] [--warmup 5] [--no-mlx] [--out PATH]``. The results (the
per-window table, the verdict, the machine, the date and the command) go to
``bench/results/soak.md``, as data ``bench/results/soak.json``, and the
daemon's log ``bench/results/soak.log``. A short
check: ``--minutes 3 --interval 20 --warmup 1 --out /tmp/soak.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shlex
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

import httpx
import psutil
import trio

from bench.engine import machine

RESULTS = REPO / "bench" / "results"
#: the 503s a client is promised (typed, with Retry-After); any other 5xx is a failure
TYPED_503 = {"capacity_timeout", "preempted", "model_capacity", "overloaded", "shutting_down"}
MODELS = ("a", "b", "tiny")


def write_config(tmp: Path, mlx: bool) -> Path:
    import yaml

    def fake(name: str) -> dict[str, Any]:
        return {"name": name, "engine": "fake", "estimated_memory_gb": 0.6, "max_queue": 16,
                "fake": {"load_seconds": 0.3, "tokens_per_second": 100}}

    models = [fake("a"), fake("b")]
    if mlx:
        models.append({"name": "tiny", "path": str(tmp / "tiny"), "demo": "tiny",
                       "estimated_memory_gb": 0.6, "max_queue": 16})
    else:
        models.append(fake("tiny"))
    raw = {
        "server": {"shutdown_grace_s": 5},
        "journal": {"path": str(tmp / "journal.db"), "synchronous": "normal"},
        "manager": {
            "memory_budget_gb": 1.0,
            "restore_on_start": False,
            "contention_policy": {"strategy": "wait_then_preempt", "wait_timeout_s": 20,
                                  "preempt_after_s": 2},
        },
        "models": models,
    }
    path = tmp / "soak.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@dataclass
class Window:
    """What the clients saw between two samples."""

    latencies: list[float] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)


@dataclass
class Traffic:
    window: Window = field(default_factory=Window)
    total: Counter[str] = field(default_factory=Counter)
    bad: list[str] = field(default_factory=list)

    def note(self, what: str, latency: float | None = None) -> None:
        self.window.outcomes[what] += 1
        self.total[what] += 1
        if latency is not None:
            self.window.latencies.append(latency)


def classify(status: int, body: str) -> str:
    if status == 200:
        return "200"
    code = None
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        pass
    return f"{status} {code}" if code else str(status)


def sse_error_code(text: str) -> str | None:
    for line in text.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            try:
                return str(json.loads(line[6:])["error"]["code"])
            except (ValueError, KeyError, TypeError):
                return "?"
    return None


async def one(c: httpx.AsyncClient, t: Traffic, rng: random.Random) -> None:
    roll = rng.random()
    model = rng.choice(MODELS)
    t0 = time.monotonic()
    if roll < 0.05:
        r = await c.post(f"/admin/models/{model}/unload",
                         params={"preempt": "true" if rng.random() < 0.5 else "false"})
        t.note("unload " + classify(r.status_code, r.text))
        return
    if roll < 0.10:
        r = await c.get("/admin/status")
        t.note("status " + classify(r.status_code, r.text))
        return
    stream = roll < 0.65
    body = {"model": model, "stream": stream, "max_tokens": rng.choice([8, 24, 60]),
            "messages": [{"role": "user", "content": f"soak {rng.random()}"}]}
    give_up = 0.5 if roll > 0.90 else 120.0  # a client that leaves while waiting or loading
    drop_after = rng.choice([1, 3]) if 0.50 < roll < 0.65 else None  # leaves mid-stream
    with trio.move_on_after(give_up) as cs:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if drop_after is not None and r.status_code == 200:
                n = 0
                async for _ in r.aiter_lines():
                    n += 1
                    if n >= drop_after:
                        break
                t.note("stream dropped")
                return
            text = (await r.aread()).decode()
        what = classify(r.status_code, text)
        if r.status_code == 200 and stream:
            code = sse_error_code(text)
            if code is not None:
                what = f"200 stream error {code}"
            elif "data: [DONE]" not in text:
                what = "200 stream cut"
        t.note(what, time.monotonic() - t0 if r.status_code == 200 else None)
        if r.status_code >= 500 and not (r.status_code == 503 and what.split()[-1] in TYPED_503):
            t.bad.append(f"{what}: {text[:200]}")
        if what == "200 stream cut" or (what.startswith("200 stream error")
                                        and what.split()[-1] not in TYPED_503):
            t.bad.append(what)
    if cs.cancelled_caught:
        t.note("client gave up")


async def client(url: str, t: Traffic, seed: int, until: float) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=180) as c:
        while time.monotonic() < until:
            try:
                await one(c, t, rng)
            except httpx.HTTPError as e:
                t.note(f"http error {type(e).__name__}")
                t.bad.append(f"{type(e).__name__}: {e}")


def journal_bytes(journal: Path) -> int:
    return sum(p.stat().st_size for p in journal.parent.glob(journal.name + "*") if p.is_file())


def sample(proc: psutil.Process, journal: Path, status: dict[str, Any], w: Window,
           minute: float) -> dict[str, Any]:
    lat = sorted(w.latencies)

    def pct(q: float) -> float | None:
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None

    return {
        "minute": round(minute, 2),
        "rss_mb": proc.memory_info().rss / 2**20,
        "fds": proc.num_fds(),
        "threads": proc.num_threads(),
        "journal_mb": journal_bytes(journal) / 2**20,
        "open_leases": len(status.get("leases", [])),
        "p50_s": pct(0.50),
        "p99_s": pct(0.99),
        "requests": sum(w.outcomes.values()),
        "outcomes": dict(w.outcomes),
    }


async def drive(url: str, pid: int, journal: Path, args: argparse.Namespace) -> tuple[list[dict[str, Any]], Traffic]:
    t = Traffic()
    proc = psutil.Process(pid)
    start = time.monotonic()
    until = start + args.minutes * 60
    samples: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery, httpx.AsyncClient(base_url=url, timeout=30) as admin:
        for i in range(args.clients):
            nursery.start_soon(client, url, t, i, until)
        samples.append(sample(proc, journal, {}, t.window, 0.0))
        while time.monotonic() < until:
            await trio.sleep(min(args.interval, max(0.0, until - time.monotonic())))
            status = (await admin.get("/admin/status")).json()
            s = sample(proc, journal, status, t.window, (time.monotonic() - start) / 60)
            t.window = Window()
            samples.append(s)
            print(f"  {s['minute']:6.1f} min  rss {s['rss_mb']:7.1f} MB  fds {s['fds']:4d}  "
                  f"threads {s['threads']:3d}  journal {s['journal_mb']:6.2f} MB  "
                  f"p99 {s['p99_s'] or 0:6.2f} s  {s['requests']} requests", flush=True)
    return samples, t


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    if len(points) < 2:
        return float("nan")
    xs, ys = zip(*points, strict=True)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else float("nan")


#: fds and threads are compared as the highest count of this many samples at each end of the
#: window after the warm-up: one sample may catch a connection or a worker thread in flight (the
#: fds of a sound run move between 19 and 20 all along), while a leak raises the highest count
EDGE_SAMPLES = 5


def grows(after: list[dict[str, Any]], key: str) -> tuple[int, int]:
    """The highest ``key`` among the first and among the last :data:`EDGE_SAMPLES` samples."""
    n = max(1, min(EDGE_SAMPLES, len(after) // 2))
    return max(s[key] for s in after[:n]), max(s[key] for s in after[-n:])


def verdict(samples: list[dict[str, Any]], t: Traffic, end: dict[str, Any], warmup: float) -> dict[str, Any]:
    after = [s for s in samples if s["minute"] >= warmup] or samples[-2:]
    rss = slope([(s["minute"], s["rss_mb"]) for s in after])
    fds, threads = grows(after, "fds"), grows(after, "threads")
    checks = {
        "rss_ok": rss < 1.0,
        "fds_ok": fds[1] <= fds[0],
        "threads_ok": threads[1] <= threads[0],
        "leases_ok": end["open_leases"] == 0,
        "responses_ok": not t.bad,
    }
    return {
        "rss_slope_mb_per_min": rss,
        "fds_after_warmup": list(fds),
        "threads_after_warmup": list(threads),
        "leaked_leases": end["open_leases"],
        "bad_responses": len(t.bad),
        "exit_code": end["exit_code"],
        "clean_stop": end["clean_stop"],
        "journal_problems": end["journal_problems"],
        **checks,
        "ok": all(checks.values()) and end["clean_stop"] == 1 and not end["journal_problems"],
    }


def finish(proc: subprocess.Popen[bytes], journal: Path) -> dict[str, Any]:
    from mlxd.journal.replay import check_journal

    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    took = time.monotonic() - t0
    with sqlite3.connect(f"file:{journal}?mode=ro", uri=True) as conn:
        open_leases = conn.execute("SELECT count(*) FROM leases WHERE released_at IS NULL").fetchone()[0]
        leases = conn.execute("SELECT count(*) FROM leases").fetchone()[0]
        outcomes = dict(conn.execute("SELECT outcome, count(*) FROM leases GROUP BY outcome").fetchall())
        transitions = conn.execute("SELECT count(*) FROM transitions").fetchone()[0]
        (clean,) = conn.execute("SELECT clean_stop FROM runs ORDER BY id DESC LIMIT 1").fetchone()
        problems = check_journal(conn)
    return {"exit_code": rc, "exit_s": took, "open_leases": open_leases, "leases": leases,
            "lease_outcomes": outcomes, "transitions": transitions, "clean_stop": clean,
            "journal_problems": problems[:10]}


def report(args: argparse.Namespace, samples: list[dict[str, Any]], t: Traffic,
           end: dict[str, Any], v: dict[str, Any], started: str, box: str) -> str:
    cmd = "python bench/soak.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        "# Soak: mixed traffic against one daemon",
        "",
        f"- date: {started}; machine: {box}",
        f"- command: `{cmd}`",
        f"- {args.minutes:g} min, {args.clients} clients, three models ({'two fakes and the tiny MLX demo model' if not args.no_mlx else 'three fakes'}), a budget for one, `wait_then_preempt`",
        "",
        "| minute | RSS MB | fds | threads | journal MB | open leases | p50 s | p99 s | requests |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in samples:
        p50 = f"{s['p50_s']:.2f}" if s["p50_s"] is not None else "-"
        p99 = f"{s['p99_s']:.2f}" if s["p99_s"] is not None else "-"
        lines.append(f"| {s['minute']:.1f} | {s['rss_mb']:.1f} | {s['fds']} | {s['threads']} | "
                     f"{s['journal_mb']:.2f} | {s['open_leases']} | {p50} | {p99} | {s['requests']} |")
    lines += [
        "",
        "Outcomes seen by the clients: " + ", ".join(f"{k}: {n}" for k, n in t.total.most_common()),
        "",
        f"Journal after SIGTERM (exit {end['exit_code']} in {end['exit_s']:.1f} s): "
        f"{end['leases']} leases ({', '.join(f'{k} {n}' for k, n in end['lease_outcomes'].items())}), "
        f"{end['transitions']} transitions, clean_stop {end['clean_stop']}, "
        f"{len(end['journal_problems'])} illegal rows.",
        "",
        "## Verdict",
        "",
        f"- RSS slope after the {args.warmup:g}-minute warm-up: {v['rss_slope_mb_per_min']:.2f} MB/min "
        f"({'ok' if v['rss_ok'] else 'FAIL'}: under 1 MB/min)",
        f"- open fds after warm-up, highest of the first -> of the last {EDGE_SAMPLES} samples: "
        f"{v['fds_after_warmup'][0]} -> {v['fds_after_warmup'][1]} ({'ok' if v['fds_ok'] else 'FAIL'})",
        f"- threads after warm-up, highest of the first -> of the last {EDGE_SAMPLES} samples: "
        f"{v['threads_after_warmup'][0]} -> "
        f"{v['threads_after_warmup'][1]} ({'ok' if v['threads_ok'] else 'FAIL'})",
        f"- leaked leases: {v['leaked_leases']} ({'ok' if v['leases_ok'] else 'FAIL'})",
        f"- responses other than 200 or a typed 503: {v['bad_responses']} "
        f"({'ok' if v['responses_ok'] else 'FAIL'})" + (f": {t.bad[:3]}" if t.bad else ""),
        f"- overall: {'PASS' if v['ok'] else 'FAIL'}",
        "",
    ]
    return "\n".join(lines)


def start_daemon(config: Path, tmp: Path, log: IO[bytes]) -> subprocess.Popen[bytes]:
    """``mlxd serve`` on ``config`` as a child (port 0, state under ``tmp``), logging to ``log``."""
    return subprocess.Popen(
        [sys.executable, "-m", "mlxd", "serve", "--config", str(config), "--port", "0",
         "--ready-file", str(tmp / "ready")],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "MLXD_STATE_DIR": str(tmp)},
    )


def wait_ready(proc: subprocess.Popen[bytes], tmp: Path) -> str:
    """The URL the daemon started by :func:`start_daemon` serves, once it is ready."""
    ready = tmp / "ready"
    deadline = time.monotonic() + 120
    while not (ready.exists() and ready.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"mlxd serve did not start:\n{(tmp / 'daemon.log').read_text()}")
        time.sleep(0.05)
    return ready.read_text().strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--interval", type=float, default=60.0, help="seconds between samples")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--warmup", type=float, default=5.0, help="minutes left out of the verdict")
    ap.add_argument("--no-mlx", action="store_true", help="three fake models (no MLX)")
    ap.add_argument("--out", type=Path, default=RESULTS / "soak.md")
    args = ap.parse_args()
    started = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    box = machine()
    with tempfile.TemporaryDirectory(prefix="mlxd-soak-") as tmp_s:
        tmp = Path(tmp_s)
        config = write_config(tmp, mlx=not args.no_mlx)
        log = open(tmp / "daemon.log", "wb")  # noqa: SIM115 - the child's
        proc = start_daemon(config, tmp, log)
        try:
            url = wait_ready(proc, tmp)
            print(f"soak: {args.minutes:g} min against {url} (pid {proc.pid})", flush=True)
            samples, t = trio.run(drive, url, proc.pid, tmp / "journal.db", args)
            end = finish(proc, tmp / "journal.db")
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tmp / "daemon.log", args.out.with_suffix(".log"))  # what it logged
        v = verdict(samples, t, end, args.warmup)
        text = report(args, samples, t, end, v, started, box)
        print(text)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"samples": samples, "end": end, "verdict": v, "outcomes": dict(t.total),
             "bad": t.bad[:50], "date": started, "machine": box}, indent=1))
    return 0 if v["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
