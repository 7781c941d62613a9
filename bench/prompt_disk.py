"""The first turn after a restart, with and without the prompt cache's disk tier.

A conversation's first turn on the ``small`` demo model (a prompt of about
``--words`` x 11 tokens, untimed), SIGTERM, a new ``mlxd serve`` on the same state
dir, the model loaded (``POST /admin/models/small/load``, untimed), then the
conversation's second turn, streamed: its time to the first token. The peer is
mlxd itself with ``prompt_cache_disk_gb: 0`` (it prefills the whole prompt
again, as every server without a disk tier does). Rounds alternate which
contender goes first; each round starts from an empty state dir. The second
turn's tokens (temperature 0) must be the same for both: the table says so.
Writes ``bench/results/prompt_disk.md``.

Run with a fast BLAS on Linux (docs/platform-facts.md, TECH-NOTES):
``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 .venv/bin/python bench/prompt_disk.py``
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import machine
from mlxd.engines.model_files.demo_model import write_demo_model
from tests.support.daemon import DaemonProcess, write_config

RESULTS = Path(__file__).resolve().parent / "results" / "prompt_disk.md"
SENTENCE = "hello world this is a tiny model for testing mlxd "


def config(state: Path, model: Path, disk_gb: float) -> Path:
    raw = {"manager": {"memory_budget_gb": 4, "prompt_cache_disk_gb": disk_gb,
                       "restore_on_start": False},
           "models": [{"name": "small", "path": str(model), "estimated_memory_gb": 0.2}]}
    return write_config(state / "models.yaml", raw)


def first_token(url: str, messages: list[dict[str, str]]) -> tuple[float, str, dict[str, Any]]:
    """A streamed turn: (seconds to the first content token, the text, the usage)."""
    body = {"model": "small", "messages": messages, "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = choice.get("delta", {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
            usage = chunk.get("usage") or usage
    assert ttft is not None, "no token came"
    return ttft, "".join(text), usage


def one(model: Path, disk_gb: float, words: int) -> dict[str, Any]:
    """One contender's round (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-disk-") as tmp:
        state = Path(tmp)
        cfg = config(state, model, disk_gb)
        prompt = SENTENCE * words
        d = DaemonProcess(cfg, state)
        d.start(timeout=120)
        try:
            first = httpx.post(d.url + "/v1/chat/completions", timeout=600, json={
                "model": "small", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 8, "temperature": 0}).json()
        finally:
            d.terminate(120)
        reply = first["choices"][0]["message"]["content"]
        turn = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply},
                {"role": "user", "content": "and then what happened to the quick brown fox"}]
        with DaemonProcess(cfg, state) as again:
            httpx.post(again.url + "/admin/models/small/load", timeout=600).raise_for_status()
            ttft, text, usage = first_token(again.url, turn)
    return {"ttft": ttft, "text": text, "prompt": usage.get("prompt_tokens", 0),
            "cached": usage.get("mlxd_cached_tokens", {}), "first_prompt": first["usage"]["prompt_tokens"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--words", type=int, default=160, help="sentences in the first turn (~11 tokens each)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="mlxd-bench-small-"))
    model = work / "small"
    write_demo_model(model, "small")
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            res = one(model, 2.0 if mode == "on" else 0.0, args.words)
            runs[mode].append(res)
            print(f"round {r + 1} {mode}: TTFT {res['ttft']:.3f} s, cached {res['cached']}", flush=True)
    lines = render(runs, args, time.monotonic() - started)
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    return 0


def render(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, took: float) -> list[str]:
    ratios = [off["ttft"] / on["ttft"] for on, off in zip(runs["on"], runs["off"], strict=True)]
    same = all(a["text"] == b["text"] for a, b in zip(runs["on"], runs["off"], strict=True))
    lines = [
        "# First turn after a restart: prompt cache disk tier on vs off",
        "",
        f"- Machine: {machine()}; LD_PRELOAD={os.environ.get('LD_PRELOAD', '(none)')}",
        f"- Date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}; run took {took:.0f} s",
        f"- Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`",
        f"- Workload: the small demo model; first turn {runs['on'][0]['first_prompt']:,} prompt "
        f"tokens, second turn {runs['on'][0]['prompt']:,}; {args.rounds} rounds, alternating order; "
        "the model loaded before the timed turn",
        "- Peer: the same mlxd with `prompt_cache_disk_gb: 0` (re-prefills the whole prompt)",
        "",
        "| contender | TTFT median (s) | min | max | cached tokens (memory / disk) |",
        "|---|---|---|---|---|",
    ]
    for mode, name in (("on", "disk tier on"), ("off", "disk tier off")):
        t = [x["ttft"] for x in runs[mode]]
        c = runs[mode][0]["cached"]
        lines.append(f"| {name} | {statistics.median(t):.3f} | {min(t):.3f} | {max(t):.3f} | "
                     f"{c.get('memory', 0):,} / {c.get('disk', 0):,} |")
    lines += ["", f"Off / on, paired by round: median {statistics.median(ratios):.1f}x "
              f"(min {min(ratios):.1f}x, max {max(ratios):.1f}x). Second turn's tokens identical "
              f"on and off (temperature 0): {'yes' if same else 'NO'}."]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
