"""Engine isolation: the same MLX text engine on a thread in the daemon vs in a worker process.

What ``isolation: process`` costs, on both demo models (``tiny``: per-step
overhead dominates; ``small``: the model's compute dominates). Two
contenders, each run in its own fresh subprocess, alternating:

* ``thread``: :class:`mlxd.engines.mlx_text.MlxTextEngine` in this process
  (its own MLX thread), as ``isolation: thread`` runs it;
* ``process``: :class:`mlxd.engines.workers.process.ProcessEngine`, the same engine
  class in a worker process, requests and tokens over a pipe.

Figures (same definitions for both; Trio consumers, greedy, fixed prompt):

* first load: seconds from ``await engine.load(...)`` until it returns, the
  first in the benchmark process (which has imported mlx-lm before the clock
  starts); for ``process`` with no spare worker ready, so the worker must start
  Python and import mlx-lm itself: the cost of a worker started from nothing;
* next load: the same for a second engine of the model, after the first is
  stopped; for ``process`` the spare worker the daemon keeps ready (Python
  started, mlx-lm imported) takes it, which is the usual case in the daemon;
* decode: ``(tokens - 1) / (arrival of the last token - arrival of the first)``
  of one stream, arrival being when the token reaches the Trio consumer;
* first token: seconds from the call until the first token of a 1-token
  request (a short prompt), the median of ``--requests`` requests: what a
  request pays per round trip (``prepare`` and ``generate`` cross the pipe);
* concurrent: total tokens per second of ``--streams`` streams at once.

Each row's figure is the median of paired ratios (run ``i`` of each contender
are neighbours in time). The verdict, which decides the default ``isolation``:
``process`` if it costs at most 5% on every row but the first load (the daemon's
spare worker hides that one) for every model, else ``thread``. Results go to
``bench/results/isolation.md``.

Run: ``.venv/bin/python bench/isolation.py [--runs 5] [--tokens 128] [--models tiny,small]``;
``--quick`` runs one small pass and writes nothing.
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

from bench.engine import PROMPT, RESULTS, TOLERANCE, machine


def child(kind: str, model: str, tokens: int, requests: int, streams: int) -> dict[str, float]:
    import mlx_lm  # noqa: F401  (imported before the clock)
    import trio

    from mlxd.config import ModelConfig
    from mlxd.engines.base import GenerationRequest, TextDelta
    from mlxd.engines.mlx_text import MlxTextEngine
    from mlxd.engines.workers.process import ProcessEngine
    from mlxd.engines.workers.worker_process import Workers

    config = ModelConfig(name="bench", source=model, isolation=kind)  # type: ignore[arg-type]

    async def stream(engine: object, n: int, arrivals: list[float]) -> None:
        req = GenerationRequest(kind="completion", prompt=PROMPT, max_tokens=n, temperature=0.0)
        async for ev in engine.generate(req):  # type: ignore[attr-defined]
            if isinstance(ev, TextDelta):
                arrivals.append(time.perf_counter())

    workers = Workers()  # the owner of the process engine's workers (and of the spare)

    def make() -> MlxTextEngine | ProcessEngine:
        return MlxTextEngine(config) if kind == "thread" else ProcessEngine(config, workers)

    async def run() -> dict[str, float]:
        async with trio.open_nursery() as owner:
            await owner.start(workers.run)
            figures = await measure()
            owner.cancel_scope.cancel()
        return figures

    async def measure() -> dict[str, float]:
        engine = make()
        t0 = time.perf_counter()
        await engine.load(lambda _p: None)
        load_s = time.perf_counter() - t0
        await engine.stop()
        await workers.spare_ready()  # the spare this load left (process) has done its imports
        engine = make()
        t0 = time.perf_counter()
        await engine.load(lambda _p: None)
        next_load_s = time.perf_counter() - t0
        try:
            await stream(engine, 8, [])  # warm-up: compiled kernels, caches
            arrivals: list[float] = []
            await stream(engine, tokens, arrivals)
            firsts = []
            for _ in range(requests):
                t = time.perf_counter()
                got: list[float] = []
                await stream(engine, 1, got)
                firsts.append(got[0] - t)
            together: list[list[float]] = [[] for _ in range(streams)]
            t = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for a in together:
                    nursery.start_soon(stream, engine, tokens, a)
            concurrent = sum(len(a) for a in together) / (time.perf_counter() - t)
        finally:
            await engine.stop()
        n = len(arrivals)
        return {
            "load_s": load_s,
            "next_load_s": next_load_s,
            "decode_tps": (n - 1) / (arrivals[-1] - arrivals[0]),
            "first_token_ms": 1000 * statistics.median(firsts),
            "concurrent_tps": concurrent,
        }

    return trio.run(run)


def run_child(kind: str, model: str, args: argparse.Namespace) -> dict[str, float]:
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--model-dir",
            model,
            "--tokens",
            str(args.tokens),
            "--requests",
            str(args.requests),
            "--streams",
            str(args.streams),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


ROWS = [  # key, label, format, higher is better
    ("load_s", "first load (process: no spare worker), s", ".3f", False),
    ("next_load_s", "next load (process: the spare worker), s", ".3f", False),
    ("decode_tps", "decode, tok/s (one stream)", ".1f", True),
    ("first_token_ms", "first token of a 1-token request, ms", ".2f", False),
    ("concurrent_tps", "concurrent streams, total tok/s", ".1f", True),
]


#: rows the default is decided on: a first load without a spare worker is rare in the daemon
DECIDING = {"next_load_s", "decode_tps", "first_token_ms", "concurrent_tps"}


def table(name: str, results: dict[str, list[dict[str, float]]], over: list[str]) -> list[str]:
    """The model's Markdown table; appends to ``over`` each deciding row where process costs > 5%."""
    lines = [
        f"### `{name}` demo model",
        "",
        "| measurement | thread | process | process / thread (median of pairs) | cost of process |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, label, fmt, higher in ROWS:
        t = [r[key] for r in results["thread"]]
        p = [r[key] for r in results["process"]]
        ratio = statistics.median(b / a for a, b in zip(t, p, strict=True))
        cost = (1 - ratio) if higher else (ratio - 1)
        if key in DECIDING and cost > TOLERANCE:
            over.append(f"{name}: {label} {100 * cost:+.1f}%")
        lines.append(
            f"| {label} | {format(statistics.median(t), fmt)} ({format(min(t), fmt)}-{format(max(t), fmt)}) "
            f"| {format(statistics.median(p), fmt)} ({format(min(p), fmt)}-{format(max(p), fmt)}) "
            f"| {ratio:.3f} | {100 * cost:+.1f}% |"
        )
    return [*lines, ""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--runs", type=int, default=5, help="runs of each contender per model (default 5)"
    )
    ap.add_argument("--tokens", type=int, default=128, help="tokens per stream (default 128)")
    ap.add_argument(
        "--requests", type=int, default=20, help="1-token requests per run (default 20)"
    )
    ap.add_argument("--streams", type=int, default=4, help="concurrent streams (default 4)")
    ap.add_argument(
        "--models", default="tiny,small", help="demo models to run (default tiny,small)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="one run of 16 tokens, 3 requests; write nothing"
    )
    ap.add_argument("--out", default=str(RESULTS / "isolation.md"), help="Markdown results file")
    ap.add_argument("--child", choices=["thread", "process"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(
            json.dumps(child(args.child, args.model_dir, args.tokens, args.requests, args.streams))
        )
        return 0
    if args.quick:
        args.runs, args.tokens, args.requests = 1, 16, 3
    header = machine()
    sections: list[str] = []
    over: list[str] = []
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-") as tmp:
        from mlxd.engines.model_files.demo_model import write_demo_model

        for name in args.models.split(","):
            path = str(Path(tmp) / name)
            write_demo_model(path, name)
            results: dict[str, list[dict[str, float]]] = {"thread": [], "process": []}
            for i in range(args.runs):
                for kind in ("thread", "process") if i % 2 == 0 else ("process", "thread"):
                    r = run_child(kind, path, args)
                    results[kind].append(r)
                    print(
                        f"{name} run {i + 1} {kind:7s} "
                        + "  ".join(f"{k} {v:.3f}" for k, v in r.items()),
                        file=sys.stderr,
                    )
            sections += table(name, results, over)
    cmd = (
        f"python bench/isolation.py --runs {args.runs} --tokens {args.tokens} --requests "
        f"{args.requests} --streams {args.streams} --models {args.models}"
    )
    lines = [
        "# Engine isolation: thread vs process",
        "",
        f"Machine: {header}; date {dt.date.today().isoformat()}; command: `{cmd}`",
        "",
        f"The MLX text engine on a thread in the benchmark process (`isolation: thread`) and the same "
        f"engine in a worker process (`isolation: process`), {args.runs} runs of each in fresh "
        f"processes, alternating; {args.tokens} greedy tokens per stream, {args.requests} 1-token "
        f"requests, {args.streams} concurrent streams. Each cell: the median run (range). The cost "
        "column is how much worse process is than thread (negative: better).",
        "",
        *sections,
        f"**Verdict: default `isolation: {'thread' if over else 'process'}`.** "
        + (
            f"Process costs more than {TOLERANCE:.0%} on: {'; '.join(over)}."
            if over
            else f"Process costs at most {TOLERANCE:.0%} on every row but the first load."
        ),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
