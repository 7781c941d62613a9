"""mlxd side by side with vllm-mlx (continuous batching) and mlx_lm.server: one command.

What it does, in order:

1. writes the demo models (``tiny`` and ``small``, and a copy of each for swaps)
   under ``bench/work/`` with ``mlxd demo-model``;
2. installs each peer in its own virtual environment under ``bench/peers/``
   (git-ignored): ``vllm-mlx`` and ``mlx-lm`` (for ``mlx_lm.server``), each with
   ``mlx[cpu]`` on Linux; an existing environment is reused;
3. for each model, starts the servers on 127.0.0.1 with the same model files,
   one after the other (their cold starts), and runs the same workloads against
   each, interleaved: every row is measured on one server right after the other,
   ``--rounds`` times in a rotating order, while the servers not being measured
   are paused (SIGSTOP), so that a machine whose speed drifts during the run
   moves every server's figure alike; a row's figure pools its rounds
   (percentiles of all the requests, the median of the rates):

   * single stream (after one untimed request of the same shape, which leaves the
     system prompt in each server's prompt cache): latency of a 1-token request and the CPU time the server's
     processes spend on one (a figure less moved by other work on the machine),
     time to first token (TTFT) and decode tok/s (the extra tokens of a request of
     ``DECODE_FACTOR`` x ``--tokens`` over its extra time against one of ``--tokens``, medians);
   * ``--clients`` concurrent streams (1, 4, 8, 16, 32): aggregate tok/s,
     TTFT p50/p99, errors;
   * ``--conversations`` ``--turns``-turn conversations a round: TTFT of each turn (the
     prompt cache), the median over all of them;
   * swap: models A and B alternating under a budget that fits one and not both,
     as each server counts memory (mlxd and vllm-mlx, the two with a memory
     budget): mean request latency;
   * cold start: process start to the first streamed token.

Tokens are counted by this script, never taken from a server's ``usage``:
the streamed text of each request is encoded with the model's own tokenizer
(``tokenizer.json``), the same count for every server. Everything is greedy
(temperature 0) with the same prompts, so the three servers produce the same
text. Results: ``bench/RESULTS.md`` (every figure, the ratio mlxd / better peer
on each row, machine, date, versions) and ``bench/results.png``.

Run (the full run, on a quiet machine): ``.venv/bin/python bench/compare.py``.
``--scale reduced`` runs every row of the full table with fewer, shorter
requests (about 30 minutes on 2 cores) and writes the same files; ``--quick``
(``--scale quick``) is a smoke pass on the tiny model that writes nothing
unless ``--out`` is given. Any workload flag overrides its preset value, and
RESULTS.md states the workload it was measured with.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))
sys.path.append(str(HERE))  # after the installed modules: a script here never shadows one

import timeline  # bench/timeline.py, beside this script

from mlxd import blas  # every server runs MLX on the same BLAS

WORK = HERE / "work"
PEERS = HERE / "peers"
SERVERS = ("mlxd", "mlx_lm.server", "vllm-mlx")
PEER_PACKAGES = {"vllm-mlx": ["vllm-mlx"], "mlx_lm.server": ["mlx-lm"]}
SYSTEM = "You are a helpful assistant. Answer in a few sentences."
QUESTIONS = [
    "tell me about the quick brown fox",
    "what is the capital of the sea",
    "describe a small town by the sea",
    "why is the sky blue",
]


#: the decode row compares requests of --tokens and of this many times --tokens
DECODE_FACTOR = 4
#: mlxd's max_batch_size for the bench's models (the 32 clients of the largest row share one batch)
MLXD_MAX_BATCH = 32
#: the X-Request-Id of each request, unique in a run (mlxd's access log names it)
REQUEST_IDS = itertools.count(1)
#: ``{"isolation": ...}`` for mlxd's models when ``--isolation`` is given (else mlxd's default)
ISOLATION: dict[str, str] = {}


# ---- setup -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_models(kinds: list[str]) -> dict[str, Path]:
    from mlxd.engines.model_files.demo_model import TEXT_SHAPES, is_model_dir, write_demo_model

    def current(path: Path, kind: str) -> bool:
        """A model written by this mlxd's ``demo-model`` (an older one's shape is rewritten)."""
        if not is_model_dir(path):
            return False
        config = json.loads((path / "config.json").read_text())
        return all(config.get(k) == v for k, v in TEXT_SHAPES.get(kind, {}).items())

    out: dict[str, Path] = {}
    for kind in kinds:
        for suffix in ("", "-b"):
            path = WORK / "models" / f"{kind}{suffix}"
            if not current(path, kind):
                shutil.rmtree(path, ignore_errors=True)
                if suffix and current(WORK / "models" / kind, kind):
                    shutil.copytree(WORK / "models" / kind, path)
                else:
                    write_demo_model(path, kind)  # type: ignore[arg-type]
            out[f"{kind}{suffix}"] = path
    return out


def peer_python(name: str) -> Path:
    """The peer's own virtual environment (created and installed on first use)."""
    venv = PEERS / name
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        extra = ["mlx[cpu]"] if sys.platform.startswith("linux") else []
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *PEER_PACKAGES[name], *extra], check=True
        )
    return python


def version_of(python: Path, package: str) -> str:
    code = f"from importlib.metadata import version; print(version({package!r}))"
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return r.stdout.strip() or "?"


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    model_ids: dict[str, str]  # model key -> id in requests
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log: Path) -> None:
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            # every server, mlxd and its peers alike, runs MLX on the same BLAS (mlxd.blas)
            env=blas.environment(blas.choose(), {**os.environ, **self.env}),
            start_new_session=True,
        )

    def cpu_seconds(self) -> float:
        """CPU time used so far by the server's live processes (its session), -1 off Linux.

        Less sensitive to other work on the machine than a wall time: the row
        made with it still compares servers on a busy box.
        """
        if self.proc is None or not Path("/proc/self/stat").exists():
            return -1.0
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone meanwhile
            if int(fields[3]) == self.proc.pid:  # session id (started with start_new_session)
                total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
        return total / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.proc = None


def make_server(
    name: str, models: dict[str, Path], keys: list[str], tmp: Path, budget_gb: float
) -> Server:
    port = free_port()
    ids = {k: str(models[k]) for k in keys}
    if name == "mlxd":
        ids = {k: k for k in keys}
        cfg = {
            "server": {"host": "127.0.0.1", "port": port},
            "journal": {"path": str(tmp / "journal.db"), "synchronous": "normal"},
            "manager": {
                "memory_budget_gb": budget_gb,
                "restore_on_start": False,
                "contention_policy": {"strategy": "wait", "wait_timeout_s": 120},
            },
            "models": [
                {"name": k, "path": str(models[k]), "max_batch_size": MLXD_MAX_BATCH, **ISOLATION}
                for k in keys
            ],
        }
        path = tmp / "mlxd.yaml"
        path.write_text(json.dumps(cfg))  # JSON is YAML
        argv = [sys.executable, "-m", "mlxd", "serve", "--config", str(path),
                "--access-log", str(tmp / "access.log"), "--log-format", "json"]  # fmt: skip
        return Server(name, argv, port, ids)
    python = peer_python(name)
    if name == "mlx_lm.server":
        argv = [
            str(python),
            "-m",
            "mlx_lm",
            "server",
            "--model",
            ids[keys[0]],
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        return Server(name, argv, port, ids, {"HF_HUB_OFFLINE": "1"})
    reg = tmp / "vllm.yaml"
    entries = [{"name": k, "path": str(models[k]), "continuous_batching": True} for k in keys]
    reg.write_text(json.dumps({"manager": {"memory_budget_gb": budget_gb}, "models": entries}))
    ids = {k: k for k in keys}
    argv = [
        str(python.parent / "vllm-mlx"),
        "serve",
        "--models-config",
        str(reg),
        "--continuous-batching",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return Server(name, argv, port, ids, {"HF_HUB_OFFLINE": "1"})


# ---- the client --------------------------------------------------------------------------


@dataclass
class Result:
    ok: bool
    ttft: float | None = None
    seconds: float = 0.0
    text: str = ""
    error: str | None = None
    #: the X-Request-Id it was sent with, and when (time.time()): see bench/timeline.py
    rid: str = ""
    sent_at: float = 0.0


async def chat(
    client: Any, server: Server, model: str, messages: list[dict[str, str]], max_tokens: int
) -> Result:
    body = {
        "model": server.model_ids[model],
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    rid = f"bench-{next(REQUEST_IDS)}"
    sent_at = time.time()
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    url = server.url + "/v1/chat/completions"
    try:
        async with client.stream("POST", url, json=body, headers={"X-Request-Id": rid}) as r:
            if r.status_code != 200:
                return Result(
                    False, error=f"HTTP {r.status_code}", seconds=time.perf_counter() - t0
                )
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    return Result(False, error=str(obj["error"])[:80])
                for choice in obj.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        parts.append(piece)
    except Exception as e:  # counted as an error of the row
        return Result(False, error=type(e).__name__, seconds=time.perf_counter() - t0)
    return Result(True, ttft, time.perf_counter() - t0, "".join(parts), rid=rid, sent_at=sent_at)


async def wait_ready(server: Server, model: str, limit_s: float = 600) -> float:
    """Poll with a 1-token request until the server answers; seconds since its start."""
    import httpx

    deadline = time.perf_counter() + limit_s
    async with httpx.AsyncClient(timeout=60) as client:
        while time.perf_counter() < deadline:
            if server.proc is not None and server.proc.poll() is not None:
                raise SystemExit(f"{server.name} exited with {server.proc.returncode}")
            r = await chat(client, server, model, [{"role": "user", "content": "hi"}], 1)
            if r.ok and r.ttft is not None:
                return time.perf_counter() - server.started_at
            await asyncio.sleep(0.2)
    raise SystemExit(f"{server.name} was not ready after {limit_s} s")


class Counter:
    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def __call__(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids) if text else 0


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


async def run_concurrent(
    server: Server, model: str, clients: int, per_client: int, tokens: int, count: Counter
) -> dict[str, Any]:
    import httpx

    results: list[Result] = []

    async def one_client(i: int, client: Any) -> None:
        for j in range(per_client):
            q = QUESTIONS[(i + j) % len(QUESTIONS)]
            msgs = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{q} ({i})"},
            ]
            results.append(await chat(client, server, model, msgs, tokens))

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_client(i, client) for i in range(clients)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    # a failed request never got its first token: it counts as slower than any that did, so a
    # server that drops requests under load is not credited with the survivors' percentiles
    ttfts = [r.ttft for r in ok if r.ttft is not None] + [math.inf] * (len(results) - len(ok))
    return {
        "tok_s": sum(count(r.text) for r in ok) / wall,
        "ttft_p50": pct(ttfts, 0.5),
        "ttft_p99": pct(ttfts, 0.99),
        "seconds_p50": pct([r.seconds for r in ok], 0.5),
        "tokens_p50": pct([float(count(r.text)) for r in ok], 0.5),
        "errors": len(results) - len(ok),
        "requests": len(results),
        # the raw figures, which merge() pools across rounds
        "ttfts": ttfts,
        "seconds": [r.seconds for r in ok],
        "tokens": [float(count(r.text)) for r in ok],
        "traces": [(r.ttft, r.rid, r.sent_at) for r in ok if r.ttft is not None],
    }


async def run_conversation(
    server: Server, model: str, turns: int, tokens: int, rnd: int = 0
) -> list[float | None]:
    """TTFT of each turn of one conversation (round ``rnd``'s own wording, so no round
    finds another's turns in a prompt cache; the system prompt is shared, as in use)."""
    import httpx

    msgs = [{"role": "system", "content": SYSTEM}]
    out: list[float | None] = []
    async with httpx.AsyncClient(timeout=600) as client:
        for t in range(turns):
            msgs.append(
                {
                    "role": "user",
                    "content": f"{QUESTIONS[(t + rnd) % len(QUESTIONS)]}, part {t + 1} of take {rnd + 1}",
                }
            )
            r = await chat(client, server, model, msgs, tokens)
            out.append(r.ttft)
            msgs.append({"role": "assistant", "content": r.text})
    return out


async def run_swap(server: Server, keys: list[str], rounds: int, tokens: int) -> dict[str, Any]:
    import httpx

    times: list[float] = []
    errors = 0
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(rounds):
            key = keys[i % 2]
            r = await chat(client, server, key, [{"role": "user", "content": QUESTIONS[0]}], tokens)
            errors += not r.ok
            times.append(r.seconds)
    return {"mean_s": statistics.mean(times), "errors": errors}


# ---- one server, one model -----------------------------------------------------------------


def decode_rate(long: dict[str, Any], short: dict[str, Any]) -> float | None:
    """Decode tok/s from two full-length request sizes: the extra tokens over the extra time.

    Measured this way, not from the chunks' arrival times, so that a server that
    holds tokens back and sends them in bursts is not credited with the burst's
    speed. Both sizes are ordinary generations (``--tokens`` and DECODE_FACTOR x that), so
    the prefill, the first token and any fixed per-request cost cancel out for
    every server alike; against a 1-token request they did not: a server whose
    1-token path is slow (vllm-mlx's took 1.1 s on the small model, its 32-token
    request less) was credited with the difference as decode speed. The long one is
    4x, not 2x: 32 extra tokens of the tiny model take ~25 ms, which the jitter of two
    medians moved by a third (vllm-mlx measured 3,422 tok/s of decode and 686 of aggregate).
    """
    try:
        extra_tokens = long["tokens_p50"] - short["tokens_p50"]
        extra_s = long["seconds_p50"] - short["seconds_p50"]
    except TypeError:  # no successful request
        return None
    return extra_tokens / extra_s if extra_tokens > 0 and extra_s > 0 else None


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's figures from its rounds: percentiles of the pooled requests, the median rate."""
    ttfts = [t for p in parts for t in p["ttfts"]]
    return {
        "tok_s": statistics.median(p["tok_s"] for p in parts),
        "ttft_p50": pct(ttfts, 0.5),
        "ttft_p99": pct(ttfts, 0.99),
        "seconds_p50": pct([s for p in parts for s in p["seconds"]], 0.5),
        "tokens_p50": pct([t for p in parts for t in p["tokens"]], 0.5),
        "errors": sum(p["errors"] for p in parts),
        "requests": sum(p["requests"] for p in parts),
        "traces": [t for p in parts for t in p["traces"]],
    }


def median_of(values: tuple[float | None, ...]) -> float | None:
    """The median of the figures there are (a failed request has none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


class Paused:
    """Every server but the one measured is stopped (SIGSTOP), so none takes CPU from it."""

    def __init__(self, servers: dict[str, Server]) -> None:
        self.servers = servers

    def only(self, name: str) -> None:
        for other, server in self.servers.items():
            if server.proc is not None:
                os.killpg(server.proc.pid, signal.SIGCONT if other == name else signal.SIGSTOP)

    def resume_all(self) -> None:
        for server in self.servers.values():
            if server.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.proc.pid, signal.SIGCONT)


def start_all(
    servers: dict[str, Server], names: list[str], kind: str, models: dict[str, Path],
    tmp: Path, count: Counter, tokens: int,
) -> dict[str, float]:
    """Start ``names`` on ``kind`` into ``servers`` (the caller stops them), one cold start at
    a time with the others paused; each server's seconds to its first token."""
    paused = Paused(servers)
    cold: dict[str, float] = {}
    for name in names:
        home = tmp / name
        home.mkdir()
        servers[name] = make_server(name, models, [kind], home, 8.0)
        paused.only("")
        servers[name].start(home / "server.log")
        cold[name] = asyncio.run(wait_ready(servers[name], kind))
        # one untimed request of the workload's shape, so that every server's prompt cache
        # holds the system prompt as on a server in use: otherwise the single-stream median
        # of a few requests is the one that prefilled it (2.6 s against 0.3 s for 16 tokens
        # on the small model, where prefill costs as much per token as decode)
        asyncio.run(run_concurrent(servers[name], kind, 1, 1, tokens, count))
    return cold


def measure_kind(
    kind: str, names: list[str], models: dict[str, Path], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Every server on ``kind``, interleaved: each row is measured on one server after
    the other, ``--rounds`` times in a rotating order, so a machine whose speed drifts
    over the minutes of a run (this one's varied 1.5-3x between runs) moves all three
    alike; the servers not measured are paused."""
    count = Counter(models[kind])
    out: dict[str, dict[str, Any]] = {n: {} for n in names}
    servers: dict[str, Server] = {}
    paused = Paused(servers)
    with tempfile.TemporaryDirectory(prefix="mlxd-compare-") as tmp:
        try:
            cold = start_all(servers, names, kind, models, Path(tmp), count, args.tokens)
            for name in names:
                out[name]["cold_start_s"] = cold[name]
            phases = rows_to_measure(kind, count, args)
            raw: dict[str, dict[str, list[Any]]] = {n: {p: [] for p in phases} for n in names}
            rounds = args.rounds[kind]
            for rnd in range(rounds):
                order = names[rnd % len(names) :] + names[: rnd % len(names)]
                print(f"{kind}: round {rnd + 1} of {rounds}", file=sys.stderr)
                for phase, run_phase in phases.items():
                    for name in order:
                        paused.only(name)
                        raw[name][phase].append(run_phase(servers[name], rnd))
            access = timeline.read_access_log(Path(tmp) / "mlxd" / "access.log")
        finally:
            paused.resume_all()
            for server in servers.values():
                server.stop()
    for name in names:
        r = raw[name]
        single = merge(r["single"])
        one = merge([p for p, _cpu in r["one"]])
        cpu = sum(c for _p, c in r["one"])
        single["one_token_s"] = one["seconds_p50"]
        single["one_token_cpu_s"] = cpu / one["requests"] if cpu >= 0 else None
        single["decode_tok_s"] = decode_rate(merge(r["long"]), single)
        out[name]["single"] = single
        out[name]["clients"] = {n: merge(r[f"clients {n}"]) for n in args.clients}
        if name == "mlxd":
            rows = out[name]["clients"]
            out[name]["slowest"] = {n: timeline.slowest(rows[n]["traces"], access, 3) for n in rows}
            out[name]["median"] = {
                n: m for n in rows if (m := timeline.median_spans(rows[n]["traces"], access))
            }
        conversations = [c for rnd in r["turns"] for c in rnd]
        out[name]["turns"] = [median_of(takes) for takes in zip(*conversations, strict=True)]
        if name != "mlx_lm.server" and args.swap_rounds > 0:
            out[name]["swap"] = measure_swap(name, kind, models, args)
    return out


Phase = Callable[[Server, int], Any]


def rows_to_measure(kind: str, count: Counter, args: argparse.Namespace) -> dict[str, Phase]:
    """The workloads of one round, by name; each takes the server and the round's number."""

    def single(server: Server, _rnd: int) -> Any:
        return asyncio.run(
            run_concurrent(server, kind, 1, args.single_requests, args.tokens, count)
        )

    def one(server: Server, _rnd: int) -> Any:
        # 1-token requests are cheap: at least 20 a round, for a CPU figure above the clock's tick
        cpu0 = server.cpu_seconds()
        result = asyncio.run(
            run_concurrent(server, kind, 1, max(20, args.single_requests), 1, count)
        )
        return result, server.cpu_seconds() - cpu0 if cpu0 >= 0 else -1.0

    def long(server: Server, _rnd: int) -> Any:
        return asyncio.run(
            run_concurrent(
                server, kind, 1, args.single_requests, DECODE_FACTOR * args.tokens, count
            )
        )

    def clients(n: int) -> Phase:
        return lambda server, _rnd: asyncio.run(
            run_concurrent(server, kind, n, args.per_client, args.tokens, count)
        )

    def turns(server: Server, rnd: int) -> Any:
        # --conversations a round, each its own wording: a turn's figure is the median of all
        takes = range(rnd * args.conversations, (rnd + 1) * args.conversations)
        return [
            asyncio.run(run_conversation(server, kind, args.turns, args.turn_tokens, take))
            for take in takes
        ]

    phases: dict[str, Phase] = {"single": single, "one": one, "long": long}
    phases.update({f"clients {n}": clients(n) for n in args.clients})
    phases["turns"] = turns
    return phases


def swap_budget_gb(name: str, kind: str, models: dict[str, Path]) -> float:
    """A budget that fits one of the two swap models and not both, as ``name`` counts memory.

    mlxd commits a model's weights and its caches (``kv_cache_gb``, whose default is
    ``max_batch_size`` sequences of 2,048 tokens, and ``prompt_cache_gb``, 8,192 tokens); vllm-mlx's
    registry counts weights only. One budget for both let vllm-mlx keep both models
    resident, so it never swapped: each server gets 1.5 x what one model costs it.
    """
    from mlxd.config.kv import (
        DEFAULT_PROMPT_CACHE_TOKENS,
        DEFAULT_SEQUENCE_TOKENS,
        kv_bytes_per_token,
        read_model_config,
    )

    one_model = sum(f.stat().st_size for f in models[kind].glob("*.safetensors"))
    if name == "mlxd":
        per_token = kv_bytes_per_token(read_model_config(str(models[kind])) or {}) or 0
        tokens = DEFAULT_SEQUENCE_TOKENS * MLXD_MAX_BATCH + DEFAULT_PROMPT_CACHE_TOKENS
        one_model += per_token * tokens
    return round(one_model * 1.5 / 2**30, 4)


def measure_swap(
    name: str, kind: str, models: dict[str, Path], args: argparse.Namespace
) -> dict[str, Any]:
    keys = [kind, f"{kind}-b"]
    budget_gb = swap_budget_gb(name, kind, models)
    with tempfile.TemporaryDirectory(prefix="mlxd-swap-") as tmp:
        server = make_server(name, models, keys, Path(tmp), budget_gb)
        server.start(Path(tmp) / "server.log")
        try:
            asyncio.run(wait_ready(server, kind))
            return asyncio.run(run_swap(server, keys, args.swap_rounds, args.tokens))
        finally:
            server.stop()


# ---- the report --------------------------------------------------------------------------


def rows_of(
    results: dict[str, dict[str, Any]], args: argparse.Namespace
) -> list[tuple[str, str, bool, dict[str, float | None]]]:
    """(row label, unit, higher is better, figure per server)."""

    def get(fn: Any) -> dict[str, float | None]:
        out = {}
        for s, r in results.items():
            try:
                out[s] = fn(r)
            except (KeyError, TypeError):
                out[s] = None
        return out

    rows = [
        (
            "single stream: max_tokens=1 latency",
            "ms",
            False,
            get(lambda r: r["single"]["one_token_s"] * 1000),
        ),
        (
            "single stream: server CPU per 1-token request",
            "ms",
            False,
            get(lambda r: r["single"]["one_token_cpu_s"] * 1000),
        ),
        ("single stream: TTFT", "ms", False, get(lambda r: r["single"]["ttft_p50"] * 1000)),
        ("single stream: decode", "tok/s", True, get(lambda r: r["single"]["decode_tok_s"])),
    ]
    for n in args.clients:
        rows.append(
            (f"{n} clients: aggregate", "tok/s", True, get(lambda r, n=n: r["clients"][n]["tok_s"]))
        )
        rows.append(
            (
                f"{n} clients: TTFT p50",
                "ms",
                False,
                get(lambda r, n=n: r["clients"][n]["ttft_p50"] * 1000),
            )
        )
        rows.append(
            (
                f"{n} clients: TTFT p99",
                "ms",
                False,
                get(lambda r, n=n: r["clients"][n]["ttft_p99"] * 1000),
            )
        )
    for t in range(args.turns):
        rows.append(
            (
                f"conversation turn {t + 1}: TTFT",
                "ms",
                False,
                get(lambda r, t=t: r["turns"][t] * 1000),
            )
        )
    rows.append(("swap A/B: mean request", "s", False, get(lambda r: r["swap"]["mean_s"])))
    rows.append(("cold start to first token", "s", False, get(lambda r: r["cold_start_s"])))
    return rows


def ratio(row: tuple[str, str, bool, dict[str, float | None]]) -> float | None:
    _label, _unit, higher, figs = row
    mine = figs.get("mlxd")
    peers = [v for k, v in figs.items() if k != "mlxd" and v]
    if not mine or not peers:
        return None
    best = max(peers) if higher else min(peers)
    return mine / best if higher else best / mine  # >= 1.00: mlxd at or above the better peer


def cell(value: float | None) -> str:
    """A figure of the table: "-" when there is none, "failed" for a percentile that falls
    on failed requests (no first token)."""
    if value is None:
        return "-"
    return f"{value:.1f}" if math.isfinite(value) else "failed"


def render(
    all_results: dict[str, dict[str, dict[str, Any]]],
    args: argparse.Namespace,
    versions: dict[str, str],
    elapsed_s: float,
) -> str:
    load = os.getloadavg()[0]
    clients = ", ".join(map(str, args.clients))
    lines = [
        "# mlxd vs vllm-mlx and mlx_lm.server",
        "",
        f"Machine: {platform.system()} {platform.release()} {platform.machine()}, {os.cpu_count()} CPUs; "
        f"Python {platform.python_version()}; load average {load:.2f} at the end",
        f"Date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"Command: `python bench/compare.py {' '.join(sys.argv[1:])}` ({elapsed_s / 60:.1f} min)",
        "",
        f"Workload (scale `{args.scale}`): models {args.models}; single stream "
        f"{args.single_requests} requests; {clients} concurrent clients, {args.per_client} "
        f"request(s) each; {args.conversations} {args.turns}-turn conversation(s) a round; "
        f"{args.swap_rounds} swap requests. "
        f"Each row measured {rounds_text(args)} on every server, interleaved (the others paused).",
        "",
        f"Greedy chat streams of {args.tokens} tokens (conversation turns: {args.turn_tokens}); tokens "
        "counted by this script with the model's tokenizer. Ratio: mlxd / better peer, oriented so "
        "that >= 1.00 means mlxd is at or above the better peer (for times: peer / mlxd). TTFT "
        "percentiles count a failed request as one that never got its first token (slower than "
        "any that did; \"failed\" where the percentile falls on one).",
        "",
    ]
    for kind, results in all_results.items():
        servers = list(results)
        lines += [
            f"## {kind} model",
            "",
            "| row | unit | " + " | ".join(servers) + " | ratio |",
            "|---|---|" + "---:|" * (len(servers) + 1),
        ]
        for row in rows_of(results, args):
            figs = row[3]
            cells = [cell(figs.get(s)) for s in servers]
            r = ratio(row)
            lines.append(
                f"| {row[0]} | {row[1]} | " + " | ".join(cells) + f" | {r:.2f} |"
                if r
                else f"| {row[0]} | {row[1]} | " + " | ".join(cells) + " | - |"
            )
        errs = {
            s: sum(c["errors"] for c in results[s].get("clients", {}).values()) for s in servers
        }
        lines += [
            "",
            "Errors in the concurrent rows: " + ", ".join(f"{s} {e}" for s, e in errs.items()),
            "",
        ]
        own = results.get("mlxd", {}).get("clients", {})
        if 1 in own and 8 in own:
            lines.append(
                f"mlxd 8 clients / 1 client aggregate: {own[8]['tok_s'] / own[1]['tok_s']:.2f}x"
            )
            lines.append("")
        if results.get("mlxd", {}).get("slowest"):
            lines += timeline.render(results["mlxd"]["slowest"], results["mlxd"]["median"])
    return "\n".join(lines)


def plot(
    all_results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace, out: Path
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "no results.png: install the bench extra (pip install -e '.[bench]')", file=sys.stderr
        )
        return
    kinds = list(all_results)
    fig, axes = plt.subplots(len(kinds), 2, figsize=(11, 4 * len(kinds)), squeeze=False)
    for i, kind in enumerate(kinds):
        for s, r in all_results[kind].items():
            xs = [n for n in args.clients if n in r.get("clients", {})]
            axes[i][0].plot(xs, [r["clients"][n]["tok_s"] for n in xs], marker="o", label=s)
            turns = r.get("turns", [])
            axes[i][1].plot(
                range(1, len(turns) + 1), [(t or 0) * 1000 for t in turns], marker="o", label=s
            )
        axes[i][0].set(title=f"{kind}: aggregate tok/s", xlabel="clients", ylabel="tok/s")
        axes[i][1].set(title=f"{kind}: TTFT per conversation turn", xlabel="turn", ylabel="ms")
        axes[i][0].legend()
        axes[i][1].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


#: workload presets; any flag given on the command line overrides its preset value
SCALES: dict[str, dict[str, Any]] = {
    # the full table (quiet machine, about an hour on 2 cores)
    "full": dict(
        models="tiny,small", clients="1,4,8,16,32", tokens=64, per_client=1,
        single_requests=3, turns=10, turn_tokens=32, swap_rounds=6, rounds="tiny=10,small=3",
        conversations=2,
    ),
    # every row of the full table, with fewer and shorter requests (~30 min)
    "reduced": dict(
        models="tiny,small", clients="1,4,8,16,32", tokens=32, per_client=1,
        single_requests=3, turns=5, turn_tokens=16, swap_rounds=4, rounds="tiny=15,small=5",
        conversations=3,
    ),
    # a smoke pass of every row kind on the tiny model (a couple of minutes)
    "quick": dict(
        models="tiny", clients="1,4", tokens=16, per_client=1,
        single_requests=2, turns=3, turn_tokens=8, swap_rounds=2, rounds="1", conversations=1,
    ),
}  # fmt: skip


def parse_rounds(
    ap: argparse.ArgumentParser, text: str, kinds: list[str], *, strict: bool
) -> dict[str, int]:
    """``--rounds``: ``N`` for every model, or ``kind=N,...`` (a model not named gets 3).
    ``strict``: the user wrote it, so a model it names must be among ``--models`` (a
    preset's names models that ``--models`` may have left out)."""
    try:
        if "=" in text:
            given = {k.strip(): int(n) for k, n in (part.split("=") for part in text.split(","))}
        else:
            given = dict.fromkeys(kinds, int(text))
    except ValueError:
        ap.error(f"--rounds {text!r}: give a number, or kind=number pairs (tiny=15,small=5)")
    unknown = set(given) - set(kinds)
    if unknown and strict:
        ap.error(f"--rounds names {', '.join(sorted(unknown))}, not among --models {','.join(kinds)}")
    if any(n < 1 for n in given.values()):
        ap.error(f"--rounds {text!r}: every model needs at least one round")
    return {k: given.get(k, 3) for k in kinds}


def rounds_text(args: argparse.Namespace) -> str:
    """``5 times``, or ``15 times (tiny), 5 times (small)``."""
    counts = set(args.rounds.values())
    if len(counts) == 1:
        return f"{counts.pop()} times"
    return ", ".join(f"{n} times ({kind})" for kind, n in args.rounds.items())


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--scale",
        choices=list(SCALES),
        default="full",
        help="workload preset (full: the issue's table; reduced: ~30 min; quick: smoke)",
    )
    ap.add_argument("--quick", action="store_true", help="same as --scale quick")
    ap.add_argument("--models", help="comma-separated demo models (tiny, small)")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--clients", help="comma-separated concurrent stream counts")
    ap.add_argument("--tokens", type=int, help="max_tokens of each request")
    ap.add_argument("--per-client", type=int, help="requests per client in the concurrent rows")
    ap.add_argument("--single-requests", type=int)
    ap.add_argument("--turns", type=int)
    ap.add_argument("--turn-tokens", type=int)
    ap.add_argument(
        "--conversations", type=int, help="conversations per round (each turn's median)"
    )
    ap.add_argument("--swap-rounds", type=int, help="0: no swap rows")
    ap.add_argument(
        "--rounds",
        help="times each row is measured on every server, interleaved (figures pool the "
        "rounds): N for every model, or per model (tiny=15,small=5: the tiny model's rows "
        "take seconds and its figures are the noisier)",
    )
    ap.add_argument(
        "--out",
        help="where the table goes (default bench/RESULTS.md; --scale quick writes "
        "nothing unless given); results.png goes next to it",
    )
    ap.add_argument(
        "--isolation",
        choices=["thread", "process"],
        help="run mlxd's models with this isolation (default: mlxd's default)",
    )
    args = ap.parse_args()
    if args.quick:
        args.scale = "quick"
    rounds_given = args.rounds is not None
    for key, value in SCALES[args.scale].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None and args.scale != "quick":
        args.out = str(HERE / "RESULTS.md")
    args.clients = [int(c) for c in args.clients.split(",")]
    args.rounds = parse_rounds(ap, args.rounds, args.models.split(","), strict=rounds_given)
    return args


def main() -> int:
    args = parse_args()
    if args.isolation:
        ISOLATION["isolation"] = args.isolation
    t0 = time.perf_counter()
    kinds = args.models.split(",")
    servers = args.servers.split(",")
    models = write_models(kinds)
    from importlib.metadata import version

    versions = {"mlxd": version("mlxd"), "mlx": version("mlx"), "mlx-lm (mlxd)": version("mlx-lm")}
    for s in servers:
        if s != "mlxd":
            pkg = PEER_PACKAGES[s][0]
            versions[s] = version_of(peer_python(s), pkg)
    all_results: dict[str, dict[str, dict[str, Any]]] = {}
    for kind in kinds:
        print(
            f"{kind}: {', '.join(servers)} ... ({time.perf_counter() - t0:.0f} s so far)",
            file=sys.stderr,
        )
        all_results[kind] = measure_kind(kind, servers, models, args)
        (WORK / "results.json").write_text(json.dumps(all_results, indent=1, default=str))
    text = render(all_results, args, versions, time.perf_counter() - t0)
    print(text)
    if args.out:
        out = Path(args.out)
        out.write_text(text)
        plot(all_results, args, out.with_name("results.png"))
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
