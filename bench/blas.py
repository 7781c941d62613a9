"""MLX's CPU backend on its reference BLAS against Debian's OpenBLAS (``mlxd.blas``).

Each round runs two fresh subprocesses on the same model, one per BLAS, in
alternating order: load, then a greedy generation of ``--tokens`` tokens from a
``--prompt-tokens`` prompt. Figures: prefill seconds (the first token's time,
which is the prompt's forward pass) and decode tokens/s after it; the verdict
is the per-round ratio (reference / OpenBLAS), median and quartiles, as
``paired.py`` reads rows. It also checks that both give the same tokens.

Run: ``.venv/bin/python bench/blas.py [--rounds 5] [--prompt-tokens 1774] [--model DIR]``
(default model: a fresh ``small`` demo model). Results: ``bench/results/blas.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time

from mlxd import blas
from mlxd.engines.model_files.demo_model import write_demo_model

RESULTS = Path(__file__).resolve().parent / "results"

_CHILD = """
import json, sys, time
import mlx_lm
from mlx_lm.sample_utils import make_sampler
model, tok = mlx_lm.load(sys.argv[1])
n, k = int(sys.argv[2]), int(sys.argv[3])
ids = [(i * 7919) % 1000 + 10 for i in range(n)]
t0 = time.perf_counter(); first = None; toks = []
for r in mlx_lm.stream_generate(model, tok, ids, max_tokens=k, sampler=make_sampler(0.0)):
    first = first or time.perf_counter()
    toks.append(r.token)
end = time.perf_counter()
print(json.dumps({"prefill_s": first - t0, "decode_tps": (len(toks) - 1) / (end - first),
                  "tokens": toks}))
"""


def run_child(model: Path, prompt_tokens: int, tokens: int, fast: bool) -> dict[str, object]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if fast:
        env = blas.environment(blas.choose({}), env)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(prompt_tokens), str(tokens)],
                         env=env, capture_output=True, text=True, check=True, timeout=3600)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=1774)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--model", help="model directory (default: a fresh small demo model)")
    ap.add_argument("--out", default=str(RESULTS / "blas.md"))
    args = ap.parse_args()
    choice = blas.choose({})
    if choice.library is None:
        print(f"bench/blas.py: nothing to compare: {choice.summary}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else Path(tmp) / "small"
        if not args.model:
            write_demo_model(model, "small")
        rows: list[tuple[dict[str, object], dict[str, object]]] = []
        for r in range(args.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            got = {fast: run_child(model, args.prompt_tokens, args.tokens, fast) for fast in order}
            rows.append((got[False], got[True]))
            print(f"round {r + 1}: reference {got[False]['prefill_s']:.2f} s, "
                  f"OpenBLAS {got[True]['prefill_s']:.2f} s", file=sys.stderr)
    same = all(ref["tokens"] == fast["tokens"] for ref, fast in rows)
    pre_ratio = [float(ref["prefill_s"]) / float(fast["prefill_s"]) for ref, fast in rows]  # type: ignore[arg-type]
    dec_ratio = [float(fast["decode_tps"]) / float(ref["decode_tps"]) for ref, fast in rows]  # type: ignore[arg-type]
    med = statistics.median
    lines = [
        "# MLX's CPU backend: reference BLAS vs OpenBLAS",
        "",
        f"Written by `bench/blas.py` on {time.strftime('%Y-%m-%d %H:%M')} ({platform.machine()}, "
        f"{os.cpu_count()} cores), model {'given' if args.model else 'small demo'}, "
        f"{args.prompt_tokens}-token prompt, {args.tokens} greedy tokens, {args.rounds} paired rounds. "
        f"OpenBLAS: `{choice.library}`.",
        "",
        "| figure | reference BLAS (median) | OpenBLAS (median) | ratio per round: q1 / median / q3 |",
        "|---|---:|---:|---|",
        f"| prefill (s, lower is better) | {med(float(a['prefill_s']) for a, _ in rows):.2f} | "  # type: ignore[arg-type]
        f"{med(float(b['prefill_s']) for _, b in rows):.2f} | "  # type: ignore[arg-type]
        "{:.1f}x / {:.1f}x / {:.1f}x faster |".format(*quartiles(pre_ratio)),
        f"| decode (tok/s) | {med(float(a['decode_tps']) for a, _ in rows):.1f} | "  # type: ignore[arg-type]
        f"{med(float(b['decode_tps']) for _, b in rows):.1f} | "  # type: ignore[arg-type]
        "{:.2f}x / {:.2f}x / {:.2f}x |".format(*quartiles(dec_ratio)),
        "",
        f"Same greedy tokens on both in every round: {'yes' if same else 'NO'}.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
