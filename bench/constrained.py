"""Per-token cost of grammar-constrained decoding, and the grammar libraries compared.

Two parts, both on a demo model's tokenizer (``--size tiny|small``, written on
first use into ``--dir``; or ``--model DIR`` for any local mlx-lm model):

1. **Libraries** (``libs``): the cost per token of computing the allowed-token
   mask and committing the sampled token, for the same JSON schema and the same
   token sequence (a valid document, tokenized), for each library that imports
   here: llguidance (mlxd's choice), outlines-core, xgrammar. Also the grammar
   compile time. Medians of ``--repeats`` passes. xgrammar imports PyTorch; a
   library that does not import is reported as such, with the reason.
2. **Decode** (``decode``): mlx-lm ``stream_generate`` on the model, greedy,
   ``--tokens`` tokens, without and with mlxd's processor
   (:func:`mlxd.engines.grammar.constrained.logits_processors`, a ``json_object``
   grammar whose budget guard stays idle until the last tokens). The per-token
   overhead is ``1/tps(constrained) - 1/tps(free)``, median over paired runs
   (free, constrained, constrained, free, ...).
3. **Batch** (``batch``): the path a loaded model takes by default
   (``max_batch_size`` > 1): mlx-lm's ``BatchGenerator`` decoding ``--width``
   sequences together, all free or each with its own processor (a different
   schema per sequence, as in a real batch: the processors run one after
   another inside each step). Aggregate tokens/s and the overhead per token
   produced, paired the same way.

Results go to ``bench/results/constrained.md`` with the machine and the date.

Run: ``.venv/bin/python bench/constrained.py [--size small] [--runs 5] [--tokens 128]``.
A quick check: ``.venv/bin/python bench/constrained.py --size tiny --runs 1 --tokens 32 --repeats 3``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string"}}},
    },
    "required": ["name", "age", "tags"],
}
DOC = {"name": "the quick brown fox jumps over the lazy dog", "age": 42,
       "tags": ["one", "two", "three four five", "memory budgets"],
       "address": {"city": "hello world", "zip": "12345"}}


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def bench_llguidance(hf: Any, vocab: int, ids: list[int], repeats: int) -> tuple[float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    ll = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    compile_s, per_token = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(ll, grammar)
        compile_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in ids:
            llguidance.numpy.fill_next_token_bitmask(m, mask)
            if not m.consume_token(t):
                raise RuntimeError(m.get_error())
        per_token.append((time.perf_counter() - t0) / len(ids))
    return _median_us(compile_s), _median_us(per_token)


def bench_outlines(hf: Any, vocab: int, ids: list[int], repeats: int) -> tuple[float, float]:
    import numpy as np
    import outlines_core

    tokens: dict[str, list[int]] = {}
    for text, i in hf.get_vocab().items():
        if i != hf.eos_token_id:
            tokens.setdefault(text, []).append(i)
    vocabulary = outlines_core.Vocabulary(hf.eos_token_id, tokens)
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    compile_s, per_token = [], []
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)
    for _ in range(repeats):
        t0 = time.perf_counter()
        guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
        compile_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in ids:
            guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
            guide.advance(t, return_tokens=False)
        per_token.append((time.perf_counter() - t0) / len(ids))
    return _median_us(compile_s), _median_us(per_token)


def bench_xgrammar(hf: Any, vocab: int, ids: list[int], repeats: int) -> tuple[float, float]:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab))
    mask = xgr.allocate_token_bitmask(1, vocab)
    compile_s, per_token = [], []
    for _ in range(repeats):
        if hasattr(compiler, "clear_cache"):
            compiler.clear_cache()  # a new schema compiles cold; a repeated one is cached
        t0 = time.perf_counter()
        grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                               separators=(",", ":"))
        matcher = xgr.GrammarMatcher(grammar)
        compile_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in ids:
            matcher.fill_next_token_bitmask(mask)
            if not matcher.accept_token(t):
                raise RuntimeError("xgrammar refused a token of a valid document")
        per_token.append((time.perf_counter() - t0) / len(ids))
    return _median_us(compile_s), _median_us(per_token)


LIBRARIES = {"llguidance": bench_llguidance, "outlines-core": bench_outlines, "xgrammar": bench_xgrammar}


def libraries(path: Path, repeats: int) -> list[str]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path))
    vocab = len(hf)
    ids = hf.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    rows = [f"Tokenizer: {path.name} ({vocab} tokens); document: {len(ids)} tokens; "
            f"median of {repeats} passes.", "",
            "| library | compile (us) | mask + commit per token (us) |", "|---|---|---|"]
    for name, fn in LIBRARIES.items():
        try:
            fn(hf, vocab, ids, 1)  # warm up
            compile_us, token_us = fn(hf, vocab, ids, repeats)
            rows.append(f"| {name} | {compile_us:.0f} | {token_us:.1f} |")
        except Exception as e:  # not installed here, or cannot load (xgrammar needs torch)
            rows.append(f"| {name} | - | not measured: {type(e).__name__}: {str(e)[:80]} |")
        print(rows[-1], flush=True)
    return rows


def paired(tps: Callable[[bool], float], runs: int) -> tuple[list[float], list[float], list[float]]:
    """``tps(constrained)`` once each to warm up (compile, tokenizer wrap), then ``runs``
    pairs in alternating order: free and constrained tokens/s, and each pair's
    overhead per token in ms."""
    tps(False), tps(True)
    free, constrained = [], []
    for i in range(runs):
        order = (False, True) if i % 2 == 0 else (True, False)
        for c in order:
            (constrained if c else free).append(tps(c))
    overhead_ms = [(1 / c - 1 / f) * 1e3 for f, c in zip(free, constrained, strict=True)]
    return free, constrained, overhead_ms


def decode(path: Path, runs: int, tokens: int) -> list[str]:
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    from mlxd.engines.base import Constraint, GenerationRequest
    from mlxd.engines.grammar.constrained import GrammarCache, logits_processors

    model, tok = load(str(path))
    vocab = int(model.args.vocab_size)
    cache = GrammarCache()
    prompt = tok.apply_chat_template([{"role": "user", "content": "json please"}],
                                     add_generation_prompt=True)

    def tps(constrained: bool) -> float:
        mx.random.seed(0)
        req = GenerationRequest(kind="chat", max_tokens=tokens * 4,
                                constraint=Constraint("json_object") if constrained else None)
        procs = logits_processors(req, tok, vocab, cache)
        times: list[float] = []
        for r in stream_generate(model, tok, prompt, max_tokens=tokens,
                                 logits_processors=procs or None):
            times.append(time.perf_counter())
            if r.finish_reason is not None:
                break
        return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")

    free, constrained, overhead_ms = paired(tps, runs)
    return [f"Model: {path.name}; greedy, up to {tokens} tokens, {runs} paired runs.", "",
            "| | tokens/s (median) |", "|---|---|",
            f"| free | {statistics.median(free):.1f} |",
            f"| json_object grammar | {statistics.median(constrained):.1f} |", "",
            f"Per-token overhead of the grammar: **{statistics.median(overhead_ms):.2f} ms** "
            f"(median of paired differences; all: {', '.join(f'{o:.2f}' for o in overhead_ms)})."]


#: one schema per sequence of the batch part (each its own grammar and matcher)
BATCH_SCHEMAS = [
    {"type": "object"},
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "x": {"type": "number"}}},
]


def batch(path: Path, runs: int, tokens: int, width: int) -> list[str]:
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator, StopSequences

    from mlxd.engines.base import Constraint, GenerationRequest
    from mlxd.engines.grammar.constrained import GrammarCache, logits_processors

    model, tok = load(str(path))
    vocab = int(model.args.vocab_size)
    cache = GrammarCache()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"json {i} please"}],
                                       add_generation_prompt=True) for i in range(width)]

    def tps(constrained: bool) -> float:
        procs: list[list[Any]] = []
        for i in range(width):
            schema = BATCH_SCHEMAS[i % len(BATCH_SCHEMAS)]
            req = GenerationRequest(kind="chat", max_tokens=tokens * 4,
                                    constraint=Constraint("json_schema", json.dumps(schema)))
            procs.append(list(logits_processors(req, tok, vocab, cache)) if constrained else [])
        gen = BatchGenerator(model, completion_batch_size=width, prefill_batch_size=width)
        try:
            gen.insert(prompts, max_tokens=[tokens] * width, logits_processors=procs,
                       stop_sequences=[StopSequences([(t,) for t in tok.eos_token_ids])] * width)
            produced, live, t0 = 0, width, None
            while live:
                _prompt, responses = gen.next()
                live -= sum(r.finish_reason is not None for r in responses)
                if t0 is None:
                    if responses:
                        t0 = time.perf_counter()  # decoding starts: prefill is not measured
                    continue
                produced += len(responses)
            return produced / (time.perf_counter() - t0) if t0 and produced else float("nan")
        finally:
            gen.close()

    free, constrained, overhead_ms = paired(tps, runs)
    return [f"Model: {path.name}; {width} sequences in one BatchGenerator, greedy, up to {tokens} "
            f"tokens each, {runs} paired runs.", "",
            "| | tokens/s, all sequences (median) |", "|---|---|",
            f"| free | {statistics.median(free):.1f} |",
            f"| {width} json_schema grammars | {statistics.median(constrained):.1f} |", "",
            f"Overhead per token produced: **{statistics.median(overhead_ms):.2f} ms** "
            f"(median of paired differences; all: {', '.join(f'{o:.2f}' for o in overhead_ms)})."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=["tiny", "small"], default="small")
    ap.add_argument("--model", type=Path, help="a local mlx-lm model directory instead of a demo model")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mlxd-bench-models"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--width", type=int, default=4, help="sequences in the batch part")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "constrained.md")
    args = ap.parse_args()
    path = args.model
    if path is None:
        from mlxd.engines.model_files.demo_model import is_model_dir, write_demo_model

        path = args.dir / args.size
        if not is_model_dir(path):
            write_demo_model(path, args.size)
    lines = [f"# Constrained decoding: per-token cost ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)",
             "", f"Machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
             f"Python {platform.python_version()}.", "", "## Grammar libraries", "",
             *libraries(path, args.repeats), "", "## Decode with mlxd's processor", "",
             *decode(path, args.runs, args.tokens), "", "## Decode in a batch", "",
             *batch(path, args.runs, args.tokens, args.width), ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
