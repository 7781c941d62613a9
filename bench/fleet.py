"""Several daemons behind LiteLLM's proxy: mlxd's strategy against LiteLLM's simple-shuffle and least-busy.

Three ``mlxd serve`` daemons on loopback, each with a budget that fits one of
three fake models (no weights: a load takes ``--load-seconds``, as a real swap
takes seconds), and ``mlxd route`` (LiteLLM's own proxy server) in front of
them with one strategy at a time; every strategy gets fresh daemons. The
workload, the same for each strategy (seeded): two clients pinned to each
model and one client that asks for a shuffled model each time, all streaming
through the official ``openai`` client. After one warm-up request per model it
measures the loads per 100 requests (counted in the three journals),
the p50 and p99 latency of a whole streamed request, and the errors.

Run: ``.venv/bin/python bench/fleet.py [--requests 300] [--load-seconds 1.0]``.
Results are printed as Markdown and written to bench/results/fleet.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, bench/ is sys.path[0]: import from the repository instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import datetime as dt
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata

import openai

from tests.support.fleet import routing_proxy, running_fleet

MODELS = ("a", "b", "c")
STRATEGIES = ("mlxd", "simple-shuffle", "least-busy")
OUT = Path(__file__).resolve().parent / "results" / "fleet.md"


@dataclass
class Result:
    strategy: str
    requests: int
    loads: int
    p50_s: float
    p99_s: float
    errors: int
    seconds: float

    def row(self) -> str:
        return (f"| {self.strategy} | {self.requests} | {self.loads} | "
                f"{100 * self.loads / self.requests:.1f} | {self.p50_s:.2f} | {self.p99_s:.2f} | "
                f"{self.errors} | {self.seconds:.0f} |")


def plans(requests: int, seed: int) -> list[list[str]]:
    """Two clients pinned to each model, and a shuffled client: ``requests`` in all."""
    per_client = requests // 7
    rng = random.Random(seed)
    pinned = [[m] * per_client for m in MODELS for _ in range(2)]
    return [*pinned, [rng.choice(MODELS) for _ in range(requests - 6 * per_client)]]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


async def _client(api: openai.AsyncOpenAI, models: list[str], latencies: list[float],
                  errors: list[str], max_tokens: int) -> None:
    for model in models:
        t0 = time.monotonic()
        try:
            stream = await api.chat.completions.create(
                model=model, stream=True, max_tokens=max_tokens,
                messages=[{"role": "user", "content": "hello fleet"}])
            async for _chunk in stream:
                pass
            latencies.append(time.monotonic() - t0)
        except openai.APIError as e:
            errors.append(f"{type(e).__name__}: {e}"[:200])


async def _workload(url: str, work: list[list[str]],
                    max_tokens: int) -> tuple[list[float], list[str], float]:
    """The latencies and errors of ``work`` after the warm-up, and when the warm-up ended (unix)."""
    latencies: list[float] = []
    errors: list[str] = []
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                  timeout=300) as api:
        for m in MODELS:  # warm-up: one request per model, not measured
            await _client(api, [m], [], [], max_tokens)
        await asyncio.sleep(1.5)
        warm = time.time()
        await asyncio.gather(*(_client(api, p, latencies, errors, max_tokens) for p in work))
    return latencies, errors, warm


def run(strategy: str, args: argparse.Namespace) -> Result:
    with tempfile.TemporaryDirectory(prefix=f"fleet-{strategy}-") as tmp_dir:
        tmp = Path(tmp_dir)
        sizes = dict.fromkeys(MODELS, 0.6)  # a 1 GB budget holds one of them
        with (
            running_fleet(tmp / "daemons", 3, sizes, 1.0, load_seconds=args.load_seconds,
                          tokens_per_second=args.tokens_per_second) as rig,
            routing_proxy(rig, tmp, strategy) as (url, _fleet),
        ):
            work = plans(args.requests, args.seed)
            latencies, errors, warm = asyncio.run(_workload(url, work, args.max_tokens))
            took = time.time() - warm
            in_all = len(rig.loads(0))
            loads = len(rig.loads(warm))
    print(f"{strategy}: {loads} loads after warm-up ({in_all} in all), {len(errors)} errors"
          + (f" (first: {errors[0]})" if errors else ""), file=sys.stderr)
    return Result(strategy, args.requests, loads, statistics.median(latencies) if latencies else 0.0,
                  _percentile(latencies, 0.99), len(errors), took)


def report(results: list[Result], args: argparse.Namespace, command: str) -> str:
    uname = platform.uname()
    machine = (f"{uname.system} {uname.release} {uname.machine}, {os.cpu_count()} CPUs, "
               f"load average {os.getloadavg()[0]:.1f} at the end; Python {platform.python_version()}, "
               f"litellm {metadata.version('litellm')}")
    lines = [
        "# Fleet: mlxd's routing strategy against LiteLLM's",
        "",
        f"Machine: {machine}; date {dt.date.today().isoformat()}; command: `{command}`",
        "",
        f"Three mlxd daemons on loopback, each with a 1 GB budget that holds one of three "
        f"fake models (0.6 GB; a load takes {args.load_seconds:g} s, generation "
        f"{args.tokens_per_second:g} tokens/s, {args.max_tokens} tokens per request), behind "
        "`mlxd route` (LiteLLM's own proxy server) with each strategy in turn, fresh daemons for "
        "each. Workload: two streaming clients pinned to each model and one client that asks "
        f"for a shuffled model each time (seed {args.seed}), {args.requests} requests after one "
        "warm-up request per model. Loads are counted in the three journals (transitions to "
        "`loading` after the warm-up); latency is a whole streamed request, seen by the client.",
        "",
        "| strategy | requests | loads | loads per 100 requests | p50 s | p99 s | errors | run s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(r.row() for r in results),
        "",
    ]
    best = min(results, key=lambda r: r.loads)
    others = [r for r in results if r is not best]
    if others:
        lines.append(f"Fewest loads: **{best.strategy}**; "
                     + "; ".join(f"{r.strategy} makes {r.loads - best.loads} more" for r in others)
                     + ".")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--load-seconds", type=float, default=1.0)
    p.add_argument("--tokens-per-second", type=float, default=100.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=35)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    results = [run(s, args) for s in args.strategies.split(",")]
    text = report(results, args, " ".join(["python bench/fleet.py", *sys.argv[1:]]))
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
