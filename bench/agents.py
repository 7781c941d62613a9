"""An agent-shaped bench: mlxd, mlx_lm.server and vllm-mlx on a coding agent's conversation.

A coding agent sends one long, fixed prefix (its system prompt and tool
definitions) and then, turn after turn, the same prefix with a tool result
appended. This script plays that conversation against each server, in the same
run, interleaved as ``compare.py`` does (each round runs every contender once,
in a rotating order, the others paused with SIGSTOP), and compares them with
paired rounds as ``paired.py`` does: per round the ratio mlxd / peer (oriented
so that above 1 favours mlxd), then the median and quartiles of the ratios. A
row is *ahead* when the lower quartile is above 1, *behind* only when the upper
quartile is below 1, else *level*.

The prefix is the recorded Claude Code first request's system text and tool
definitions (``tests/fixtures/agents/claude_code_first_request.json``), cut or
repeated to ``--prefix`` tokens of the model's tokenizer. The default,
``--prefix recorded``, is all of it (54,860 tokens of the demo tokenizer) cut to
what the model's context leaves for the turns (the small demo model's 32,768:
25,568 tokens). Each round's conversation starts with its own session line, so its
first turn finds nothing cached (a new agent session), and goes:

* turn 1: the prefix and a task (cold: the whole prefix is prefilled);
* turns 2 to ``--turns``: the reply and a tool result appended, asked again
  (prefix reuse; the row is the round's median of their TTFTs);
* swap: the other model (a copy of the same weights under another name) is
  asked, then the conversation's next turn: each server's swap is stated in
  the results (mlxd and vllm-mlx: a budget that fits one model, as each counts
  memory; mlx_lm.server serves one model and loads another when asked for it);
* restart: SIGTERM, the same command again (same state dir / SSD cache dir),
  one untimed 1-token request, then the conversation's next turn.

Then prefill tok/s: a prompt of N tokens (each round's own, nothing cached)
with ``max_tokens`` 1, its token count over its time to the first token, on
every server and on bare mlx-lm (``mlx_lm.stream_generate`` in a process of
this venv that loaded the model first). Every server and bare mlx-lm run MLX
on the same BLAS (``mlxd.blas``). vllm-mlx runs with its SSD cache on
(``--ssd-cache-dir``).

Run: ``.venv/bin/python bench/agents.py`` (the small demo model, the recorded
prefix, 10 turns, 3 rounds, prefill 2k and 8k). On this 2-core CPU box a prefill
of the recorded prefix takes minutes (attention's cost grows with the square of
the context), and a round prefills it seven times (every contender's cold turn,
and each re-prefill after a swap or a restart), so the committed results give
``--prefix 4000`` (34 min). ``--prefill 2048,8192`` (or ``--long`` to add a
32,000-token prompt), ``--rows prefill`` (the prefill rows alone) or ``--rows
agents``, ``--rounds``, ``--model tiny``, ``--servers`` override the rest. A
prefix or prompt that the model's context cannot hold is refused before anything
starts. Writes ``bench/results/agents.md`` unless ``--out`` says otherwise.

``--model large`` runs it on the largest demo model this box can hold four
times at once (735M parameters, 2.7 GiB; why that size:
``mlxd.engines.model_files.demo_model``): a cold 4,000-token turn takes about a
minute there on a quiet box, and a round about 30 (the conversation grows to
~10k tokens, which a server without a kept cache prefills again after the swap
and the restart; writing the model the first time: under a minute). A smoke
pass (``--rounds 1 --turns 2 --prefill 2048 --prefix 1000``) took 19 minutes
with the box's load average at 5. Give it ``--out bench/results/agents-large.md``;
``--long`` on it adds ~15 minutes a contender a round (a 32k prompt's attention
on CPU) and needs ~19 GiB.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))
sys.path.append(str(HERE))  # after the installed modules: a script here never shadows one

import compare  # bench/compare.py, beside this script
import paired  # bench/paired.py: quartiles as it computes them

from mlxd import blas

RECORDED = REPO / "tests" / "fixtures" / "agents" / "claude_code_first_request.json"
BARE = "bare mlx-lm"
TASK = "Fix the failing test in tests/test_parser.py and explain the change."
TOOLS = ["Read", "Grep", "Bash", "Edit", "Glob"]
#: the tokens a turn may add to the conversation (a tool result is ~490 of the demo tokenizer)
TURN_TOKENS = 600
#: ``--long``'s prompt: 32k tokens that, with the chat template and the one token asked,
#: fit the small demo model's context of 32,768
LONG = 32_000
#: the rows, their unit, and whether a higher figure is better
AGENT_ROWS = {
    "turn 1 (cold)": ("TTFT s", False),
    "turns 2-N (prefix reuse)": ("TTFT s", False),
    "first turn after a swap": ("TTFT s", False),
    "first turn after a restart": ("TTFT s", False),
}
SWAPS = {
    "mlxd": "the other model asked under a budget that fits one (mlxd evicts the idle one)",
    "mlx_lm.server": "the other model asked by its path (mlx_lm.server serves one model and "
    "loads the one asked for in its place)",
    "vllm-mlx": "the other model asked under a `--models-config` budget that fits one "
    "(vllm-mlx counts weights only)",
}


# ---- the conversation ---------------------------------------------------------------------


def recorded_text() -> str:
    """The recorded Claude Code request's system text and tool definitions, as one text."""
    body = json.loads(RECORDED.read_text())
    system = body["system"]
    text = system if isinstance(system, str) else "\n\n".join(b["text"] for b in system)
    return text + "\n\n# Tools\n\n" + json.dumps(body["tools"], indent=1)


def cut(count: compare.Counter, text: str, tokens: int) -> str:
    """``text`` repeated or cut to ``tokens`` tokens of the model's tokenizer."""
    ids: list[int] = []
    piece = count.tok.encode(text, add_special_tokens=False).ids
    while len(ids) < tokens:
        ids += piece
    return str(count.tok.decode(ids[:tokens]))


def tool_result(turn: int, tag: str) -> str:
    """A tool's output, as an agent appends it (a few hundred tokens, each turn its own)."""
    tool = TOOLS[turn % len(TOOLS)]
    lines = [f"    {i + 1:>4}  def step_{turn}_{i}(x):  # {tag}" for i in range(12)]
    return (
        f"<tool_result tool={tool!r} call={turn}>\n"
        + "\n".join(lines)
        + f"\nexit status {turn % 2}\n</tool_result>\nWhat next?"
    )


class Conversation:
    """One agent session: the prefix (its own session line first), then turns."""

    def __init__(self, prefix: str, tag: str, tokens: int) -> None:
        self.tag, self.tokens = tag, tokens
        self.messages = [
            {"role": "system", "content": f"Session {tag}.\n{prefix}"},
            {"role": "user", "content": TASK},
        ]

    async def turn(self, server: compare.Server, model: str) -> float:
        """Ask, keep the reply, append the next tool result; the TTFT (inf if it failed)."""
        import httpx

        async with httpx.AsyncClient(timeout=1800) as client:
            r = await compare.chat(client, server, model, self.messages, self.tokens)
        n = len(self.messages)
        self.messages += [
            {"role": "assistant", "content": r.text or "Let me look."},
            {"role": "user", "content": tool_result(n, self.tag)},
        ]
        if not r.ok or r.ttft is None:
            print(f"  {server.name}: turn {n // 2} failed: {r.error}", file=sys.stderr)
            return math.inf
        return r.ttft


# ---- the servers --------------------------------------------------------------------------


def mlxd_server(
    models: dict[str, Path], keys: list[str], home: Path, budget_gb: float, caches: dict[str, float]
) -> compare.Server:
    """mlxd with both models, a budget that fits one, its state (and disk tier) in ``home``."""
    port = compare.free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "journal": {"path": str(home / "journal.db"), "synchronous": "normal"},
        "manager": {"memory_budget_gb": budget_gb, "restore_on_start": False,
                    # a large model's eviction (draining, writing its prompt caches) may
                    # outlast the default 60 s on a busy box
                    "stop_timeout_s": 600,
                    "contention_policy": {"strategy": "wait", "wait_timeout_s": 600}},
        "models": [{"name": k, "path": str(models[k]), "max_batch_size": 2, **caches}
                   for k in keys],
    }  # fmt: skip
    path = home / "mlxd.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    argv = [sys.executable, "-m", "mlxd", "serve", "--config", str(path)]
    return compare.Server("mlxd", argv, port, {k: k for k in keys}, {"MLXD_STATE_DIR": str(home)})


def mlxd_caches(kind: str, models: dict[str, Path], longest: int) -> dict[str, float]:
    """``kv_cache_gb`` and ``prompt_cache_gb`` that hold the longest prompt of the run."""
    from mlxd.config.kv import kv_bytes_per_token, read_model_config

    per_token = kv_bytes_per_token(read_model_config(str(models[kind])) or {}) or 0
    kv = per_token * (longest + 1024) * 2  # max_batch_size 2
    return {"kv_cache_gb": round(kv / 2**30, 4), "prompt_cache_gb": round(kv / 2**30, 4)}


def make(name: str, kind: str, models: dict[str, Path], home: Path, longest: int) -> compare.Server:
    keys = [kind, f"{kind}-b"]
    if name == "mlxd":
        caches = mlxd_caches(kind, models, longest)
        weights = sum(f.stat().st_size for f in models[kind].glob("*.safetensors"))
        one = weights + (caches["kv_cache_gb"] + caches["prompt_cache_gb"]) * 2**30
        return mlxd_server(models, keys, home, round(one * 1.5 / 2**30, 4), caches)
    server = compare.make_server(
        name, models, keys, home, compare.swap_budget_gb(name, kind, models)
    )
    if name == "vllm-mlx":
        # its default request timeout (300 s) is shorter than a long prefill of the large model
        server.argv += ["--ssd-cache-dir", str(home / "ssd-cache"), "--timeout", "7200"]
    return server


def terminate(server: compare.Server) -> None:
    """SIGTERM and wait for the server to finish its shutdown (mlxd writes its prompt caches to
    disk then: ``Server.stop``'s 20 s before SIGKILL are too few on a busy box), then stop it."""
    if server.proc is not None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            print(f"  {server.name} did not stop within 600 s of SIGTERM", file=sys.stderr)
    server.stop()


def start(server: compare.Server, home: Path, kind: str, label: str) -> None:
    server.start(home / f"server-{label}.log")
    asyncio.run(compare.wait_ready(server, kind, limit_s=1800))


# ---- one round ----------------------------------------------------------------------------


def agent_round(
    server: compare.Server, home: Path, kind: str, prefix: str, rnd: int, args: argparse.Namespace
) -> dict[str, float]:
    """One conversation on one server: the four agent rows' figures (module docstring)."""
    convo = Conversation(prefix, f"{server.name} round {rnd + 1}", args.tokens)
    out = {"turn 1 (cold)": asyncio.run(convo.turn(server, kind))}
    later = [asyncio.run(convo.turn(server, kind)) for _ in range(args.turns - 1)]
    out["turns 2-N (prefix reuse)"] = paired.quartiles(later)[1]
    asyncio.run(compare.wait_ready(server, f"{kind}-b", limit_s=1800))  # the swap: untimed
    out["first turn after a swap"] = asyncio.run(convo.turn(server, kind))
    terminate(server)
    start(server, home, kind, f"restart-{rnd + 1}")
    out["first turn after a restart"] = asyncio.run(convo.turn(server, kind))
    return out


def prompt_of(count: compare.Counter, size: int, tag: str) -> str:
    """A user prompt of ``size`` tokens, its own from the first token (nothing cached)."""
    return cut(count, f"Request {tag}. " + " ".join(TOOLS) + " " + TASK + " ", size)


async def prefill_server(server: compare.Server, kind: str, prompts: dict[int, str],
                         count: compare.Counter) -> dict[int, float]:  # fmt: skip
    """Prompt tokens over the time to the first token, per prompt size (0: it failed)."""
    import httpx

    out: dict[int, float] = {}
    async with httpx.AsyncClient(timeout=3600) as client:
        for size, text in prompts.items():
            r = await compare.chat(client, server, kind, [{"role": "user", "content": text}], 1)
            out[size] = count(text) / r.ttft if r.ok and r.ttft else 0.0
    return out


BARE_CODE = """
import json, sys, time
from mlx_lm import load, stream_generate
model, tok = load(sys.argv[1])
prompts = json.load(sys.stdin)
def ids(text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
next(stream_generate(model, tok, ids("hi"), max_tokens=1))
out = {}
for size, text in prompts.items():
    t0 = time.perf_counter()
    next(stream_generate(model, tok, ids(text), max_tokens=1))
    out[size] = time.perf_counter() - t0
print(json.dumps(out))
"""


def prefill_bare(model: Path, prompts: dict[int, str], count: compare.Counter) -> dict[int, float]:
    """The same prompts on bare mlx-lm (in-process ``stream_generate``), on the same BLAS."""
    env = blas.environment(blas.choose(), dict(os.environ))
    r = subprocess.run(
        [sys.executable, "-c", BARE_CODE, str(model)], input=json.dumps(prompts),
        capture_output=True, text=True, env=env, timeout=7200,
    )  # fmt: skip
    if r.returncode != 0:
        print(f"  bare mlx-lm failed: {r.stderr[-500:]}", file=sys.stderr)
        return {size: 0.0 for size in prompts}
    seconds = json.loads(r.stdout.strip().splitlines()[-1])
    return {size: count(text) / seconds[str(size)] for size, text in prompts.items()}


# ---- the run ------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> tuple[dict[str, dict[str, list[float]]], dict[str, str]]:
    """Every contender's figures per row, one per round; and why a peer is missing."""
    kind = args.model
    models = compare.write_models([kind])
    count = compare.Counter(models[kind])
    source = recorded_text() if RECORDED.exists() else TASK
    prefix = cut(count, source, args.prefix_tokens) if "agents" in args.rows else ""
    conversation = args.prefix_tokens + room(args) if "agents" in args.rows else 0
    longest = max([conversation, *args.prefill])
    names: list[str] = args.servers.split(",")
    servers: dict[str, compare.Server] = {}
    paused = compare.Paused(servers)
    missing: dict[str, str] = {}
    figures: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="mlxd-agents-") as tmp:
        homes = {n: Path(tmp) / n for n in names}
        try:
            for name in names:
                homes[name].mkdir()
                paused.only("")
                try:
                    servers[name] = make(name, kind, models, homes[name], longest)
                    start(servers[name], homes[name], kind, "first")
                except (Exception, SystemExit) as e:  # a peer that cannot run here is a dash
                    missing[name] = f"{type(e).__name__}: {str(e)[:200]}"
                    print(f"{name} left out: {missing[name]}", file=sys.stderr)
                    if name in servers:
                        servers.pop(name).stop()
            contenders = [n for n in names if n in servers]
            contenders += [BARE] if "prefill" in args.rows else []
            figures = {n: {} for n in contenders}
            for rnd in range(args.rounds):
                order = contenders[rnd % len(contenders) :] + contenders[: rnd % len(contenders)]
                prompts = {
                    s: prompt_of(count, s, f"round {rnd + 1} size {s}") for s in args.prefill
                }
                print(f"round {rnd + 1} of {args.rounds}: {', '.join(order)}", file=sys.stderr)
                for name in order:
                    paused.only(name)
                    rows = one_contender(name, servers, homes, models, kind, prefix, prompts,
                                         count, rnd, args)  # fmt: skip
                    for row, value in rows.items():
                        figures[name].setdefault(row, []).append(value)
                    print(f"  {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in rows.items()),
                          file=sys.stderr)  # fmt: skip
        finally:
            paused.resume_all()
            for server in servers.values():
                server.stop()
    return figures, missing


def one_contender(
    name: str, servers: dict[str, compare.Server], homes: dict[str, Path],
    models: dict[str, Path], kind: str, prefix: str, prompts: dict[int, str],
    count: compare.Counter, rnd: int, args: argparse.Namespace,
) -> dict[str, float]:  # fmt: skip
    """One contender's round: the agent rows (servers only), then prefill (as ``--rows`` says)."""
    if name == BARE:
        rates = prefill_bare(models[kind], prompts, count)
        return {f"prefill {s:,} tokens": r for s, r in rates.items()}
    rows = {}
    if "agents" in args.rows:
        rows = agent_round(servers[name], homes[name], kind, prefix, rnd, args)
    if "prefill" in args.rows:
        rates = asyncio.run(prefill_server(servers[name], kind, prompts, count))
        rows |= {f"prefill {s:,} tokens": r for s, r in rates.items()}
    return rows


# ---- the report ---------------------------------------------------------------------------


def verdict(ratios: list[float]) -> tuple[str, str, str]:
    """(median, quartiles, ahead / level / behind) of paired ratios favouring mlxd above 1."""
    if not ratios:
        return "-", "-", "-"
    q1, q2, q3 = paired.quartiles(ratios)
    word = "ahead" if q1 > 1 else "behind" if q3 < 1 else "level"
    return f"{q2:.2f}", f"{q1:.2f} - {q3:.2f}", word


def ratios(mine: list[float], theirs: list[float], higher: bool) -> list[float]:
    """Per round, oriented so that above 1 favours mlxd (a failed figure leaves its round out)."""
    pairs = zip(mine, theirs, strict=True)
    if higher:
        return [a / b for a, b in pairs if b > 0 and math.isfinite(a)]
    return [b / a for a, b in pairs if a > 0 and math.isfinite(a)]


def cell(values: list[float] | None) -> str:
    if not values:
        return "-"
    q1, q2, q3 = paired.quartiles(values)
    return f"{q2:.3g} ({q1:.3g} - {q3:.3g})"


def overall_verdict(words: list[str]) -> str:
    """A row against every peer: behind if behind any, ahead if ahead of all, else level."""
    known = [w for w in words if w != "-"]
    if not known:
        return "-"
    if "behind" in known:
        return "behind"
    return "ahead" if all(w == "ahead" for w in known) else "level"


def row_lines(
    figures: dict[str, dict[str, list[float]]], rows: dict[str, tuple[str, bool]], peers: list[str]
) -> list[str]:
    head = ["row", "unit", *figures] + [f"mlxd vs {p}: median (quartiles)" for p in peers]
    lines = ["| " + " | ".join([*head, "verdict"]) + " |", "|---" * (len(head) + 1) + "|"]
    for row, (unit, higher) in rows.items():
        cells = [cell(figures[n].get(row)) for n in figures]
        words = []
        for peer in peers:
            mine, theirs = figures.get("mlxd", {}).get(row), figures.get(peer, {}).get(row)
            med, quart, word = verdict(ratios(mine, theirs, higher) if mine and theirs else [])
            cells.append(f"{med} ({quart}) {word}" if med != "-" else "-")
            words.append(word)
        overall = overall_verdict(words)
        lines.append("| " + " | ".join([row, unit, *cells, overall]) + " |")
    return lines


def reprefilled(figures: dict[str, dict[str, list[float]]], peer: str, row: str) -> bool:
    """Whether ``peer`` prefilled the conversation again on ``row``: in most rounds its TTFT
    there was nearer its cold turn's than its reuse turns' (above their mean)."""
    theirs = figures.get(peer, {})
    rounds = zip(
        theirs.get(row, []),
        theirs.get("turn 1 (cold)", []),
        theirs.get("turns 2-N (prefix reuse)", []),
        strict=True,
    )
    votes = [ttft > (cold + reuse) / 2 for ttft, cold, reuse in rounds]
    return sum(votes) * 2 > len(votes)


def target_lines(figures: dict[str, dict[str, list[float]]], peers: list[str]) -> list[str]:
    """The after-swap and after-restart target (at least 4x a server that re-prefills), judged
    against the peers that did re-prefill on the row; a peer that kept its cache is named."""
    lines = []
    for row in ("first turn after a swap", "first turn after a restart"):
        mine = figures.get("mlxd", {}).get(row)
        parts = []
        for peer in peers:
            theirs = figures.get(peer, {}).get(row)
            if not mine or not theirs:
                continue
            med = verdict(ratios(mine, theirs, False))[0]
            if reprefilled(figures, peer, row):
                met = "met" if med != "-" and float(med) >= 4 else "not met"
                parts.append(f"{peer} re-prefills: {med}x ({met})")
            else:
                parts.append(f"{peer} kept its cache ({med}x; the target is not about it)")
        if parts:
            lines.append(f"- {row}: " + "; ".join(parts) + ".")
    if not lines:
        return []
    return [
        "",
        "The after-swap and after-restart target, at least 4x the TTFT of a server that "
        "re-prefills (median paired ratio), judged against each peer that re-prefilled on the "
        "row (in most rounds its TTFT there nearer its cold turn's than its reuse turns'):",
        *lines,
    ]


def render(
    args: argparse.Namespace, figures: dict[str, dict[str, list[float]]],
    missing: dict[str, str], elapsed_s: float,
) -> str:  # fmt: skip
    versions = {"mlxd": version("mlxd"), "mlx": version("mlx"), "mlx-lm": version("mlx-lm")}
    for name in args.servers.split(",")[1:]:
        package = compare.PEER_PACKAGES[name][0]
        python = compare.PEERS / name / "bin" / "python"
        versions[name] = compare.version_of(python, package) if python.exists() else "-"
    servers = [n for n in args.servers.split(",") if n != "mlxd"]
    peers = [p for p in servers if p in figures] or servers
    agents = "agents" in args.rows
    prefill = {f"prefill {s:,} tokens": ("tok/s", True) for s in args.prefill}
    sizes = ", ".join(f"{s:,}" for s in args.prefill)
    title = f"a {args.prefix_tokens:,}-token prefix" if agents else f"prefill of {sizes} tokens"
    lines = [
        f"# An agent-shaped bench: the {args.model} demo model, {title}",
        "",
        f"Machine: {platform.system()} {platform.release()} {platform.machine()}, "
        f"{os.cpu_count()} CPUs; Python {platform.python_version()}; load average "
        f"{os.getloadavg()[0]:.2f} at the end; {blas.choose().summary}",
        f"Date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"Command: `python bench/agents.py {' '.join(sys.argv[1:])}` ({elapsed_s / 60:.1f} min)",
        "",
    ]
    workload = (
        f"Workload: {args.rounds} paired rounds; in each, every contender once in a rotating "
        "order (the others paused)."
    )
    if agents:
        workload += (
            f" A conversation: a prefix of {args.prefix_tokens:,} tokens "
            f"({'the recorded Claude Code system text and tools' if RECORDED.exists() else 'text'}"
            f", its own session line first), then {args.turns} turns of `max_tokens` "
            f"{args.tokens}, each appending the reply and a tool result; then the swap's turn, "
            "then the restart's."
        )
    if "prefill" in args.rows:
        workload += f" Prefill: prompts of {sizes} tokens, `max_tokens` 1, prompt tokens over TTFT."
    workload += (
        " Every figure: median (quartiles) over rounds; paired ratios favour mlxd above 1 (the "
        "peer's TTFT over mlxd's; mlxd's tok/s over the peer's); ahead: lower quartile above 1; "
        "behind: upper quartile below 1."
    )
    lines += [workload, ""]
    if agents:
        lines += [
            "Each server's swap: "
            + "; ".join(f"{n}: {SWAPS[n]}" for n in args.servers.split(","))
            + ". Restart: SIGTERM, the same command again (mlxd's state dir and vllm-mlx's "
            "`--ssd-cache-dir` kept), one untimed 1-token request.",
            "",
            *row_lines({n: f for n, f in figures.items() if n != BARE}, dict(AGENT_ROWS), peers),
            "",
        ]
    if "prefill" in args.rows:
        lines += row_lines(figures, prefill, [BARE, *peers])
    lines += [""] + [f"Left out: {n}: {why}" for n, why in missing.items()]
    lines += target_lines(figures, peers) if agents else []
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", choices=["tiny", "small", "large"])
    ap.add_argument("--servers", default=",".join(compare.SERVERS), help="mlxd first")
    ap.add_argument("--prefix", default="recorded",
                    help="prefix tokens, or 'recorded': the recorded request's system text and "
                    "tools, cut to what the model's context leaves for the turns")  # fmt: skip
    ap.add_argument("--turns", type=int, default=10, help="turns before the swap")
    ap.add_argument("--tokens", type=int, default=8, help="max_tokens of each turn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", default="2048,8192", help="prompt sizes, in tokens")
    ap.add_argument("--long", action="store_true", help=f"add the {LONG:,}-token prefill")
    ap.add_argument("--rows", default="agents,prefill",
                    help="which rows to run: agents (the conversation), prefill, or both")  # fmt: skip
    ap.add_argument("--out", default=str(HERE / "results" / "agents.md"))
    args = ap.parse_args()
    names = args.servers.split(",")
    if names[0] != "mlxd" or not set(names) <= set(compare.SERVERS):
        ap.error(f"--servers: mlxd first, then any of {', '.join(compare.SERVERS[1:])}")
    try:
        args.prefill = [int(s) for s in args.prefill.split(",") if s] + (
            [LONG] if args.long else []
        )
    except ValueError:
        ap.error(f"--prefill: token counts separated by commas (2048,8192), not {args.prefill!r}")
    args.rows = args.rows.split(",")
    model = compare.write_models([args.model])[args.model]
    context = context_of(model)
    if not args.rows or not set(args.rows) <= {"agents", "prefill"}:
        ap.error("--rows: agents, prefill, or agents,prefill")
    if "agents" not in args.rows:
        args.prefix_tokens = 0  # no conversation: no prefix to count
    elif args.prefix == "recorded":
        recorded = compare.Counter(model)(recorded_text())
        args.prefix_tokens = min(recorded, context - room(args))
    elif args.prefix.isdigit():
        args.prefix_tokens = int(args.prefix)
    else:
        ap.error(f"--prefix: a number of tokens or 'recorded', not {args.prefix!r}")
    if args.rounds < 1 or args.turns < 2 or ("agents" in args.rows and args.prefix_tokens < 1):
        ap.error("--rounds at least 1, --turns at least 2, --prefix at least 1 token")
    if "agents" in args.rows and args.prefix_tokens + room(args) > context:
        ap.error(
            f"--prefix {args.prefix_tokens:,} and {args.turns} turns need up to "
            f"{args.prefix_tokens + room(args):,} tokens, over the {args.model} model's context "
            f"of {context:,}"
        )
    over = [s for s in args.prefill if s + 64 > context]
    if "prefill" in args.rows and over:
        ap.error(
            f"--prefill {', '.join(map(str, over))}: over the {args.model} model's context of "
            f"{context:,} less 64 tokens for the chat template"
        )
    return args


def room(args: argparse.Namespace) -> int:
    """The tokens the conversation's turns add to its prefix (the swap's and the restart's too)."""
    return (args.turns + 2) * TURN_TOKENS


def context_of(model: Path) -> int:
    """The model's context length, from its config.json."""
    from mlxd.config.kv import read_model_config

    return int((read_model_config(str(model)) or {}).get("max_position_embeddings") or 0)


def main() -> int:
    args = parse_args()
    t0 = time.perf_counter()
    figures, missing = measure(args)
    text = render(args, figures, missing, time.perf_counter() - t0)
    print(text)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
