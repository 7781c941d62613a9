"""One concurrent row of ``compare.py``, many rounds: is a close figure a difference or the spread?

``compare.py`` measures each row 10-15 times per server and reports the
median rate, which is enough for rows where the servers differ by a third,
not for one where they are within 10%: on the tiny model a 32-token request
takes about 50 ms, this 2-core box moves single requests by ±20%, and the
1-client aggregate of three reduced runs read 0.82, 0.91 and 1.16 on the same
code. This script runs that one row (``--clients`` streams of ``--tokens``
tokens, one request each) on every server, interleaved exactly as
``compare.py`` does it (same servers, prompts, token counting, rotating order,
the others paused with SIGSTOP), ``--rounds`` times, and reports per server
the median rate and TTFT p50, and per peer the paired ratios: mlxd's rate in a
round over the peer's in the same round (and the peer's TTFT p50 over mlxd's),
whose median and quartiles say how often and by how much mlxd is ahead with
the box's drift taken out.

Run: ``.venv/bin/python bench/paired.py [--model tiny] [--clients 1] [--tokens 32]
[--rounds 200] [--servers mlxd,mlx_lm.server,vllm-mlx] [--out FILE]``; it writes
``bench/results/paired.md`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
import os
import platform
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))
sys.path.append(str(HERE))  # after the installed modules: a script here never shadows one

import compare  # bench/compare.py, beside this script

#: the figures of a round: aggregate tok/s, and the TTFT p50 in ms (inf: a request failed)
Figures = dict[str, list[tuple[float, float]]]


def measure(args: argparse.Namespace, names: list[str]) -> Figures:
    """The row's aggregate tok/s and TTFT p50 on every server, one pair per round."""
    models = compare.write_models([args.model])
    count = compare.Counter(models[args.model])
    servers: dict[str, compare.Server] = {}
    paused = compare.Paused(servers)
    rates: Figures = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="mlxd-paired-") as tmp:
        try:
            compare.start_all(servers, names, args.model, models, Path(tmp), count, args.tokens)
            for rnd in range(args.rounds):
                order = names[rnd % len(names) :] + names[: rnd % len(names)]
                for name in order:
                    paused.only(name)
                    row = asyncio.run(
                        compare.run_concurrent(
                            servers[name], args.model, args.clients, 1, args.tokens, count
                        )
                    )
                    ok = row["errors"] == 0
                    rates[name].append(
                        (row["tok_s"] if ok else 0.0, row["ttft_p50"] * 1000 if ok else math.inf)
                    )
                if (rnd + 1) % 50 == 0:
                    print(f"round {rnd + 1} of {args.rounds}", file=sys.stderr)
        finally:
            paused.resume_all()
            for server in servers.values():
                server.stop()
    return rates


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Nearest-rank quartiles, as compare.py's percentiles (a failed request's inf stays inf)."""
    q1, q2, q3 = (compare.pct(values, q) for q in (0.25, 0.5, 0.75))
    assert q1 is not None and q2 is not None and q3 is not None, "no rounds"
    return q1, q2, q3


def render(args: argparse.Namespace, rates: Figures, elapsed_s: float) -> str:
    names = list(rates)
    versions = {"mlxd": version("mlxd"), "mlx": version("mlx"), "mlx-lm": version("mlx-lm")}
    for name in names[1:]:
        package = compare.PEER_PACKAGES[name][0]
        versions[name] = compare.version_of(compare.peer_python(name), package)
    lines = [
        f"# One row, many rounds: {args.clients} client(s), {args.tokens}-token chats, "
        f"the {args.model} model",
        "",
        f"Machine: {platform.system()} {platform.release()} {platform.machine()}, "
        f"{os.cpu_count()} CPUs; Python {platform.python_version()}; "
        f"load average {os.getloadavg()[0]:.2f} at the end",
        f"Date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"Command: `python bench/paired.py {' '.join(sys.argv[1:])}` ({elapsed_s / 60:.1f} min)",
        "",
        f"{args.rounds} rounds; in each, every server runs the row once (a rotating order, the "
        "others paused), as in `compare.py`. Tokens counted with the model's tokenizer; a round "
        "with a failed request counts 0 tok/s and an endless TTFT for that server.",
        "",
        "| server | tok/s: median | quartiles | TTFT p50, ms: median | quartiles |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in names:
        r1, r2, r3 = quartiles([tok_s for tok_s, _ttft in rates[name]])
        t1, t2, t3 = quartiles([ttft for _tok_s, ttft in rates[name]])
        lines.append(
            f"| {name} | {r2:.1f} | {r1:.1f} - {r3:.1f} | {t2:.1f} | {t1:.1f} - {t3:.1f} |"
        )
    lines += [
        "",
        "Paired by round, oriented so that above 1 favours mlxd: mlxd's tok/s over the peer's, "
        "and the peer's TTFT p50 over mlxd's.",
        "",
        "| peer | figure | median | quartiles | rounds mlxd ahead |",
        "|---|---|---:|---:|---:|",
    ]
    for peer in names[1:]:
        mine, theirs = rates["mlxd"], rates[peer]
        paired = {
            "tok/s": [a[0] / b[0] for a, b in zip(mine, theirs, strict=True) if b[0] > 0],
            "TTFT p50": [b[1] / a[1] for a, b in zip(mine, theirs, strict=True) if a[1] > 0],
        }
        for figure, pairs in paired.items():
            if not pairs:  # the peer failed every round (mlx_lm.server does at 32 clients)
                lines.append(f"| {peer} | {figure} | - | - | the peer failed every round |")
                continue
            q1, q2, q3 = quartiles(pairs)
            ahead = sum(p > 1 for p in pairs) / len(pairs)
            lines.append(f"| {peer} | {figure} | {q2:.3f} | {q1:.3f} - {q3:.3f} | {ahead:.0%} |")
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--servers", default=",".join(compare.SERVERS), help="mlxd first")
    ap.add_argument("--clients", type=int, default=1, help="concurrent streams of the row")
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens of each request")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", default=str(HERE / "results" / "paired.md"))
    args = ap.parse_args()
    names = args.servers.split(",")
    if names[0] != "mlxd" or len(names) < 2 or not set(names) <= set(compare.SERVERS):
        ap.error(f"--servers: mlxd first, then one or more of {', '.join(compare.SERVERS[1:])}")
    if args.rounds < 4 or args.clients < 1 or args.tokens < 1:
        ap.error("--rounds needs at least 4 (for quartiles); --clients and --tokens at least 1")
    return args


def main() -> int:
    args = parse_args()
    t0 = time.perf_counter()
    rates = measure(args, args.servers.split(","))
    text = render(args, rates, time.perf_counter() - t0)
    print(text)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
