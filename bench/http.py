"""HTTP throughput and latency of mlxd against ``mlx_lm.server``, serving the same demo model.

Both servers run as child processes of this script, on 127.0.0.1, in the same
run, and are measured cell by cell:

* ``mlxd``: ``python -m mlxd serve --config CFG --port 0 --ready-file F`` with
  one model (``tiny``) and a journal in a temporary directory;
* ``mlx_lm.server``, the peer: ``python -m mlx_lm server --model DIR`` on a free
  port, with an empty Hugging Face cache (its ``/v1/models`` scans that cache).

Workloads, each at 1, 8 and 32 concurrent clients (``--clients``):

* ``GET /v1/models``;
* ``POST /v1/chat/completions`` with ``max_tokens: 1``, not streamed: with the
  same prompt every time, then with a prompt that starts with a fresh number
  each time (so mlx_lm.server's prompt cache cannot skip the prefill);
* the same with ``stream: true`` and ``max_tokens: 16``; TTFT is the time from
  sending the request to the first SSE chunk whose ``delta.content`` is not empty
  (mlxd's leading ``{"role": "assistant", "content": ""}`` chunk does not count).

Each cell is a closed loop: N workers, each with its own ``httpx.AsyncClient``
(one connection, reused whenever the server keeps it alive), send requests back
to back. A cell gives each server ``--seconds`` of measuring, split into
``--slices`` windows taken in ABBA order (mlxd, peer, peer, mlxd), so that load
from other work on this shared box lands on both servers. Each window follows
``--ramp`` seconds of unrecorded load. req/s counts the successful requests
that end inside a window, so it sees steady concurrency: not the opening burst,
and not the drain once the clients stop; latencies and errors are those of the
requests that start inside a window, each waited for to its end. Anything but a
200 with a complete body (an SSE ``error`` event, a stream without ``[DONE]``, a
timeout, a reset connection) is counted per cell and shown in the table, never
dropped; so are the errors of the ramps, apart. The CPU columns give the CPU
time each process used over the window time (100% = one core), so a reader can
see when the load generator, not the server, was the bottleneck, and when the
box was busy with something else.

Run: ``.venv/bin/python bench/http.py [--seconds 5] [--slices 4] [--ramp 1]
[--clients 1,8,32] [--workloads models,...] [--model-size tiny|small]``.
``--quick`` is a 1-second smoke pass that writes nothing unless ``--out`` is
given. Results: a Markdown table on stdout and in ``bench/results/http.md``
with the machine, the date, the versions and the command; the paragraph that
reads the numbers is added by hand to the committed file.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's folder is sys.path[0] and this file would shadow the standard
# library's `http` package (which httpx imports): take the folder off the path first.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import datetime as dt
import functools
import importlib.metadata
import itertools
import json
import math
import os
import platform
import resource
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "http.md"
PROMPT = "hello world, tell me about the quick brown fox"
REQUEST_TIMEOUT_S = 60.0
WORKLOADS = ("models", "chat-1", "chat-1-distinct", "stream-16")
WORKLOAD_TITLES = {
    "models": "`GET /v1/models`",
    "chat-1": "chat, `max_tokens` 1",
    "chat-1-distinct": "chat, `max_tokens` 1, distinct prompts",
    "stream-16": "chat stream, `max_tokens` 16",
}


# --------------------------------------------------------------------------- servers


class Server:
    """A server under test: a child process, its base URL and the model name it answers to."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path,
                 model: str) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.model = model
        self.url = ""
        self.prompt_tokens: int | None = None
        self.stopped = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env, cwd=REPO)

    def check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def cpu_seconds(self) -> float | None:
        """utime + stime of the process (all its threads) from /proc; None off Linux."""
        if self.proc is None:
            return None
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s; safe to call twice or on a process that never started."""
        if self.proc is None or self.proc.poll() is not None:
            return
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(15)
            how = f"ended by signal {-rc}" if rc < 0 else f"exited with code {rc}"
            self.stopped = f"{how} {time.monotonic() - t0:.1f} s after SIGTERM"
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            self.stopped = "ignored SIGTERM for 15 s and was killed"
        print(f"{self.name} {self.stopped}", file=sys.stderr)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_mlxd(tmp: Path, model_dir: Path) -> Server:
    state = tmp / "mlxd-state"
    state.mkdir()
    config = tmp / "mlxd.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "manager": {"memory_budget_gb": 2},
        "journal": {"path": str(tmp / "journal.db")},
        "models": [{"name": "tiny", "path": str(model_dir), "estimated_memory_gb": 0.01}],
    }, indent=2))
    ready = tmp / "mlxd.ready"
    env = {**os.environ, "MLXD_STATE_DIR": str(state)}
    server = Server("mlxd", [sys.executable, "-m", "mlxd", "serve", "--config", str(config),
                             "--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready)],
                    env, tmp / "mlxd.log", model="tiny")
    server.spawn()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if ready.exists() and ready.read_text().strip():
            server.url = ready.read_text().strip()
            return server
        server.check_alive()
        time.sleep(0.05)
    raise RuntimeError(f"mlxd not ready after 60 s:\n{server.log_tail()}")


def start_peer(tmp: Path, model_dir: Path) -> Server:
    port = free_port()
    hf = tmp / "hf-home"
    (hf / "hub").mkdir(parents=True)  # without it, its /v1/models fails after sending 200
    env = {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}
    server = Server("mlx_lm.server",
                    [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir),
                     "--host", "127.0.0.1", "--port", str(port)],
                    env, tmp / "mlx_lm_server.log", model="default_model")
    server.spawn()
    server.url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            server.check_alive()
            try:
                if client.get(server.url + "/v1/models").status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"mlx_lm.server not answering after 60 s:\n{server.log_tail()}")


# --------------------------------------------------------------------------- requests


@dataclass
class Sample:
    ok: bool
    latency: float
    ttft: float | None = None
    chunks: int = 0
    error: str = ""


_distinct = itertools.count()


def chat_body(model: str, max_tokens: int, stream: bool, distinct: bool = False) -> dict[str, Any]:
    """The request; ``distinct`` starts the prompt with a fresh number, so no prompt cache hits."""
    content = f"{next(_distinct)} {PROMPT}" if distinct else PROMPT
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": stream, "temperature": 0.0}


async def get_models(client: httpx.AsyncClient, model: str) -> Sample:
    t0 = time.perf_counter()
    r = await client.get("/v1/models")
    t = time.perf_counter() - t0
    if r.status_code != 200:
        return Sample(False, t, error=f"HTTP {r.status_code}")
    if not r.json().get("data"):
        return Sample(False, t, error="empty model list")
    return Sample(True, t)


async def chat_one_token(client: httpx.AsyncClient, model: str, distinct: bool = False) -> Sample:
    t0 = time.perf_counter()
    r = await client.post("/v1/chat/completions", json=chat_body(model, 1, False, distinct))
    t = time.perf_counter() - t0
    if r.status_code != 200:
        return Sample(False, t, error=f"HTTP {r.status_code}: {r.text[:200]}")
    body = r.json()
    if not body.get("choices"):
        return Sample(False, t, error=f"no choices: {r.text[:200]}")
    return Sample(True, t)


async def chat_stream(client: httpx.AsyncClient, model: str) -> Sample:
    t0 = time.perf_counter()
    ttft: float | None = None
    chunks = 0
    async with client.stream("POST", "/v1/chat/completions",
                             json=chat_body(model, 16, True)) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            return Sample(False, time.perf_counter() - t0, error=f"HTTP {r.status_code}: {text[:200]}")
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, ": keepalive" comments
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                return Sample(False, time.perf_counter() - t0,
                              error=f"SSE error: {json.dumps(event['error'])[:200]}")
            for choice in event.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    t = time.perf_counter() - t0
    if not done:
        return Sample(False, t, ttft, chunks, error="stream ended without [DONE]")
    if ttft is None:
        return Sample(False, t, error="stream had no content")
    return Sample(True, t, ttft, chunks)


REQUESTS: dict[str, Callable[[httpx.AsyncClient, str], Awaitable[Sample]]] = {
    "models": get_models,
    "chat-1": chat_one_token,
    "chat-1-distinct": functools.partial(chat_one_token, distinct=True),
    "stream-16": chat_stream,
}


# --------------------------------------------------------------------------- cells


@dataclass
class Cell:
    server: str
    workload: str
    clients: int
    seconds: float
    samples: list[Sample] = field(default_factory=list)
    completed: int = 0
    ramp_errors: Counter[str] = field(default_factory=Counter)
    overflows_outside: int = 0
    server_cpu: float | None = None
    client_cpu: float = 0.0
    listen_overflows: int | None = None
    other_cpu: float | None = None

    def add(self, window: Window, seconds: float) -> None:
        """Fold one measuring window into the cell (CPU figures become shares of all windows)."""
        before = self.seconds
        self.seconds += seconds
        self.samples.extend(window.samples)
        self.completed += window.completed
        self.ramp_errors.update(window.ramp_errors)
        if window.overflows_outside is not None:
            self.overflows_outside += window.overflows_outside
        u0, u1 = window.start, window.end

        def mean(old: float | None, new: float | None) -> float | None:
            if new is None:
                return None
            return ((old or 0.0) * before + new * seconds) / self.seconds

        client = (u1.client - u0.client) / seconds
        server = None if u0.server is None or u1.server is None else (u1.server - u0.server) / seconds
        other = None
        if server is not None and u0.box is not None and u1.box is not None:
            other = max(0.0, (u1.box - u0.box) / seconds - server - client)
        self.client_cpu = mean(self.client_cpu, client) or 0.0
        self.server_cpu = mean(self.server_cpu, server)
        self.other_cpu = mean(self.other_cpu, other)
        if u0.overflows is not None and u1.overflows is not None:
            self.listen_overflows = (self.listen_overflows or 0) + u1.overflows - u0.overflows

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    @property
    def errors(self) -> Counter[str]:
        return Counter(s.error for s in self.samples if not s.ok)

    @property
    def rps(self) -> float:
        return self.completed / self.seconds if self.seconds else 0.0

    def pct(self, q: float, attr: str = "latency") -> float | None:
        values: list[float] = sorted(v for s in self.ok if (v := getattr(s, attr)) is not None)
        if not values:
            return None
        return values[min(len(values), max(1, math.ceil(q * len(values)))) - 1]  # nearest rank


@dataclass
class Window:
    """What one measuring window saw (see :func:`drive`)."""

    samples: list[Sample]
    completed: int
    start: Usage
    end: Usage
    ramp_errors: list[str]
    overflows_outside: int | None  # listen drops during the ramp and the drain


@dataclass
class Usage:
    """Counters read at the start and at the end of a measuring window."""

    server: float | None
    client: float
    box: float | None
    overflows: int | None

    @classmethod
    def now(cls, server: Server) -> Usage:
        return cls(server.cpu_seconds(), client_cpu_seconds(), box_busy_seconds(),
                   listen_overflows())


async def drive(server: Server, clients: list[httpx.AsyncClient], workload: str, ramp: float,
                seconds: float) -> Window:
    """One worker per client, back to back, for ``ramp`` then ``seconds``.

    Returns the requests that started inside the measuring window (after the ramp,
    waited for to the end, so a slow one is never cut off) and the number of
    successful requests that ended inside it (throughput at steady load: the
    burst of N simultaneous first requests falls in the ramp, and the drain once
    the clients stop, with fewer than N in flight, falls after the window).
    """
    request = REQUESTS[workload]
    samples: list[Sample] = []
    t_start = time.perf_counter() + ramp
    t_end = t_start + seconds
    marks: list[Usage] = []
    completed = 0
    ramp_errors: list[str] = []
    overflows0 = listen_overflows()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal completed
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            try:
                sample = await request(client, server.model)
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                sample = Sample(False, time.perf_counter() - t0,
                                error=f"{type(e).__name__}: {str(e)[:120]}")
                await trio.sleep(0.01)  # a dead server must not turn this into a busy loop
            if t_start <= t0:
                samples.append(sample)
            elif not sample.ok:
                ramp_errors.append(sample.error)
            if sample.ok and t_start <= t0 + sample.latency <= t_end:
                completed += 1

    async def meter() -> None:
        await trio.sleep_until(trio.current_time() + (t_start - time.perf_counter()))
        marks.append(Usage.now(server))
        await trio.sleep_until(trio.current_time() + (t_end - time.perf_counter()))
        marks.append(Usage.now(server))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(meter)
        for client in clients:
            nursery.start_soon(worker, client)
    overflows1 = listen_overflows()
    in0, in1 = marks[0].overflows, marks[1].overflows
    outside = None
    if overflows0 is not None and overflows1 is not None and in0 is not None and in1 is not None:
        outside = (overflows1 - overflows0) - (in1 - in0)
    return Window(samples, completed, marks[0], marks[1], ramp_errors, outside)


def listen_overflows() -> int | None:
    """The kernel's count of connections dropped because a listen queue was full (Linux)."""
    try:
        rows = [line.split() for line in Path("/proc/net/netstat").read_text().splitlines()
                if line.startswith("TcpExt:")]
        return int(dict(zip(rows[0], rows[1], strict=True))["ListenOverflows"])
    except (OSError, IndexError, KeyError, ValueError):
        return None


def box_busy_seconds() -> float | None:
    """CPU seconds all processes on the box spent busy (not idle or iowait), from /proc/stat."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user..steal, minus idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def client_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def measure(servers: list[Server], workload: str, clients: int, seconds: float,
                  ramp: float, slices: int) -> list[Cell]:
    """One cell for every server: ``slices`` windows each, in ABBA order, so a burst of
    load from elsewhere on the box lands on both servers rather than on one."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    # Clients are built (an SSL context each: milliseconds of CPU) before any clock starts.
    pools = {s.name: [httpx.AsyncClient(base_url=s.url, timeout=REQUEST_TIMEOUT_S, limits=limits)
                      for _ in range(clients)] for s in servers}
    cells = {s.name: Cell(s.name, workload, clients, 0.0) for s in servers}
    try:
        for i in range(slices):
            for server in servers if i % 2 == 0 else servers[::-1]:
                server.check_alive()
                window = await drive(server, pools[server.name], workload, ramp, seconds / slices)
                cells[server.name].add(window, seconds / slices)
    finally:
        for pool in pools.values():
            for client in pool:
                await client.aclose()
    return [cells[s.name] for s in servers]


async def warm_up(server: Server) -> None:
    """One completion and one stream, so the model is loaded before anything is timed."""
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        r = await client.post("/v1/chat/completions", json=chat_body(server.model, 1, False))
        if r.status_code != 200:
            raise RuntimeError(f"{server.name} warm-up failed: {r.status_code} {r.text}\n"
                               f"{server.log_tail()}")
        server.prompt_tokens = r.json()["usage"]["prompt_tokens"]
        s = await chat_stream(client, server.model)
        if not s.ok:
            raise RuntimeError(f"{server.name} warm-up stream failed: {s.error}\n{server.log_tail()}")


async def run_all(servers: list[Server], workloads: list[str], clients: list[int],
                  seconds: float, ramp: float, slices: int) -> list[Cell]:
    for server in servers:
        await warm_up(server)
    cells: list[Cell] = []
    for workload in workloads:
        for n in clients:
            for cell in await measure(servers, workload, n, seconds, ramp, slices):
                cells.append(cell)
                print(f"  {cell.server:14} {workload:15} {n:3} clients: {row_summary(cell)}",
                      file=sys.stderr, flush=True)
    return cells


# --------------------------------------------------------------------------- report


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def pct_cpu(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def counted(errors: Counter[str]) -> str:
    parts = [f"{n} x {msg}" for msg, n in errors.most_common(3)]
    more = len(errors) - 3
    return "; ".join(parts) + (f"; +{more} other kinds" if more > 0 else "")


def errors_text(cell: Cell) -> str:
    text = counted(cell.errors) if cell.errors else "0"
    if cell.ramp_errors:
        text += f" (and in the ramps: {counted(cell.ramp_errors)})"
    return text


def drops_text(cell: Cell) -> str:
    if cell.listen_overflows is None:
        return "-"
    if cell.overflows_outside:
        return f"{cell.listen_overflows} (+{cell.overflows_outside} in ramps/drains)"
    return str(cell.listen_overflows)


def row_summary(cell: Cell) -> str:
    return (f"{cell.rps:.1f} req/s, p50 {ms(cell.pct(0.5))} ms, p99 {ms(cell.pct(0.99))} ms, "
            f"ttft p50 {ms(cell.pct(0.5, 'ttft'))} ms, errors {sum(cell.errors.values())}")


def table(cells: list[Cell]) -> str:
    lines = [
        "| workload | clients | server | ok | errors | req/s | p50 ms | p99 ms | TTFT p50 ms "
        "| TTFT p99 ms | server CPU | client CPU | other CPU | listen drops |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        stream = c.workload == "stream-16"
        lines.append(
            f"| {WORKLOAD_TITLES[c.workload]} | {c.clients} | {c.server} | {len(c.ok)} "
            f"| {errors_text(c).replace('|', '/')} | {c.rps:.1f} | {ms(c.pct(0.5))} | {ms(c.pct(0.99))} "
            f"| {ms(c.pct(0.5, 'ttft')) if stream else '-'} | {ms(c.pct(0.99, 'ttft')) if stream else '-'} "
            f"| {pct_cpu(c.server_cpu)} | {pct_cpu(c.client_cpu)} | {pct_cpu(c.other_cpu)} "
            f"| {drops_text(c)} |"
        )
    return "\n".join(lines)


def ratios(cells: list[Cell], servers: list[Server]) -> str:
    """mlxd's req/s and p50 as a multiple of the peer's, per cell."""
    mine, peer = servers[0].name, servers[1].name
    by = {(c.server, c.workload, c.clients): c for c in cells}
    lines = ["| workload | clients | req/s mlxd ÷ peer | p50 mlxd ÷ peer | TTFT p50 mlxd ÷ peer |",
             "|---|---:|---:|---:|---:|"]
    for (server, workload, n), c in by.items():
        if server != mine or (peer, workload, n) not in by:
            continue
        p = by[(peer, workload, n)]

        def ratio(a: float | None, b: float | None) -> str:
            return "-" if not a or not b else f"{a / b:.2f}"

        ttft = ratio(c.pct(0.5, "ttft"), p.pct(0.5, "ttft")) if workload == "stream-16" else "-"
        lines.append(f"| {WORKLOAD_TITLES[workload]} | {n} | {ratio(c.rps, p.rps)} "
                     f"| {ratio(c.pct(0.5), p.pct(0.5))} | {ttft} |")
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.processor() or "?"
    ram = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = f"{int(line.split()[1]) / 1024 ** 2:.0f} GB"
                break
    except OSError:
        pass
    return (f"{platform.system()} {platform.release()} {platform.machine()}, {cpu}, "
            f"{os.cpu_count()} CPUs, {ram} RAM; Python {platform.python_version()}")


def versions() -> str:
    names = ("mlxd", "mlx", "mlx-lm", "httpx", "trio", "hypercorn", "quart-trio")
    out = []
    for n in names:
        try:
            out.append(f"{n} {importlib.metadata.version(n)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{n} ?")
    return ", ".join(out)


def stream_chunks(cells: list[Cell]) -> str:
    """Mean content chunks per successful stream, per server (the work each stream did)."""
    chunks: dict[str, list[int]] = {}
    for c in cells:
        if c.workload == "stream-16":
            chunks.setdefault(c.server, []).extend(s.chunks for s in c.ok)
    return ", ".join(f"{name} {sum(v) / len(v):.1f}" for name, v in chunks.items() if v)


def report(cells: list[Cell], servers: list[Server], args: argparse.Namespace, params: int,
           started: dt.datetime, load_before: tuple[float, ...], load_after: tuple[float, ...]) -> str:
    command = "python bench/http.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    prompt_tokens = ", ".join(f"{s.name} {s.prompt_tokens}" for s in servers)
    return f"""# HTTP: mlxd vs mlx_lm.server

Machine: {machine()}; load average {load_before[0]:.2f} at start, {load_after[0]:.2f} at the end
Date: {started:%Y-%m-%d %H:%M} (local)
Versions: {versions()}
Command: `{command.strip()}`

Model: the `{args.model_size}` demo model written by `mlxd demo-model` ({params:,} parameters,
random fp32 llama), served by both. mlxd: `python -m mlxd serve` with that one model
(`estimated_memory_gb: 0.01`, budget 2 GB, journal in a temp dir). Peer: `python -m mlx_lm server
--model DIR` with default flags (continuous batching, prompt cache on) and an empty
Hugging Face cache. Both on 127.0.0.1, each warmed up with one completion and one stream.

Method: N concurrent clients (one `httpx.AsyncClient` each, one connection, reused when the
server allows it) send requests back to back. Each cell gives each server {args.seconds:g} s of
measuring, split into {args.slices} windows taken in ABBA order (mlxd, peer, peer, mlxd, ...), so
load from elsewhere on the box falls on both; each window follows {args.ramp:g} s of unrecorded
load. req/s is successful requests that ended inside a window per second of window; "ok",
"errors" and the latencies are over the requests that started inside a window (each waited for
to its end); p50/p99 are nearest-rank (with few requests, p99 is the maximum).
The chat prompt is one short user message ("{PROMPT}"; prompt tokens after the chat template:
{prompt_tokens}), greedy, the same in every request except in the "distinct prompts" rows,
where it starts with a number never sent before, so the peer's prompt cache cannot skip the
prefill. Streams ask for 16 tokens; TTFT is the time to the first SSE chunk with non-empty
`delta.content`; mean content chunks per stream: {stream_chunks(cells)}.

CPU columns: CPU time used during the windows, over their length (100% = one core; the box has
{os.cpu_count()} cores in all), by the server, by the load generator (this script), and by every
other process ("other": the idle server, the kernel, anything else running, from `/proc/stat`;
when it is large, the cell was measured on a busy machine). "listen drops" is the kernel's
`ListenOverflows` counter over the windows: connections whose handshake was dropped because the
server's accept queue was full; the client retransmits after 1 s, so each costs about a second.
Errors and drops during the unrecorded ramps (where all N clients start at once) and the drains
are shown in brackets, not hidden.

{table(cells)}

mlxd relative to the peer (above 1 for req/s is better for mlxd, below 1 for latency is better):

{ratios(cells, servers)}
"""


# --------------------------------------------------------------------------- main


def make_model(tmp: Path, size: str) -> tuple[Path, int]:
    path = tmp / f"demo-{size}"
    # a child process, so the load generator never imports MLX
    subprocess.run([sys.executable, "-m", "mlxd", "demo-model", str(path), "--size", size],
                   cwd=REPO, capture_output=True, text=True, check=True)
    return path, safetensors_params(path / "model.safetensors")


def safetensors_params(path: Path) -> int:
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    total = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        n = 1
        for d in meta["shape"]:
            n *= d
        total += n
    return total


def log_errors(log: str) -> list[str]:
    """The last line of every traceback and every ERROR line of a server log."""
    out: list[str] = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if " ERROR " in line or "error id" in line:
            out.append(line.strip())
        elif line.startswith("Traceback"):
            j = i + 1
            while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
                j += 1
            if j < len(lines):
                out.append(lines[j].strip())
    return out


def interrupted(signum: int, _frame: object) -> None:
    """SIGTERM takes the same path as Ctrl-C (Trio's own SIGINT handling included), so
    main's finally stops both servers."""
    os.kill(os.getpid(), signal.SIGINT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per cell")
    parser.add_argument("--ramp", type=float, default=1.0,
                        help="unrecorded seconds of load before each measuring window")
    parser.add_argument("--slices", type=int, default=4,
                        help="windows per server and cell, in ABBA order (--seconds is split)")
    parser.add_argument("--clients", default="1,8,32", help="comma-separated concurrency levels")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    parser.add_argument("--model-size", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--quick", action="store_true", help="1-second cells, a smoke check")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write the Markdown (default {RESULTS.relative_to(REPO)}; "
                             "--quick writes nothing unless this is given)")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.ramp = 1.0, 0.3
    out = args.out or (None if args.quick else RESULTS)
    clients = [int(c) for c in args.clients.split(",")]
    workloads = [w for w in args.workloads.split(",") if w]
    if unknown := set(workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")

    # A shell starts background jobs with SIGINT ignored; restore it so Ctrl-C, SIGINT and
    # SIGTERM (relayed as SIGINT) always reach the finally that stops the servers.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, interrupted)

    started = dt.datetime.now()
    load_before = os.getloadavg()
    servers: list[Server] = []
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-http-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            model_dir, params = make_model(tmp, args.model_size)
            print(f"model: {args.model_size} demo ({params:,} parameters) in {model_dir}", file=sys.stderr)
            servers.append(start_mlxd(tmp, model_dir))
            servers.append(start_peer(tmp, model_dir))
            for s in servers:
                print(f"{s.name} at {s.url} (pid {s.proc.pid if s.proc else '?'})", file=sys.stderr)
            cells = trio.run(run_all, servers, workloads, clients, args.seconds, args.ramp,
                             args.slices)
            for s in servers:
                s.check_alive()
        except BaseException:
            for s in servers:
                print(f"--- last lines of the {s.name} log ---\n{s.log_tail()}", file=sys.stderr)
            raise
        finally:
            for s in reversed(servers):
                s.stop()
        failures = {s.name: log_errors(s.log_tail(100_000)) for s in servers}
    text = report(cells, servers, args, params, started, load_before, os.getloadavg())
    text += "\nAt the end: " + "; ".join(f"{s.name} {s.stopped}" for s in servers) + ".\n"
    for name, lines in failures.items():
        if lines:
            text += f"\nError lines in the {name} log ({len(lines)}; distinct ones, at most 10):\n\n"
            text += "\n".join(f"    {line}" for line in list(dict.fromkeys(lines))[:10]) + "\n"
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
