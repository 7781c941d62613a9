"""What a long prompt costs the engine: tokenizing off the MLX thread, memory given back after."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import trio

from mlxd.engines.mlx_text import MlxTextEngine
from tests.engines.mlx_helpers import chat, collect, completion

REPO = Path(__file__).resolve().parents[2]


async def test_a_long_tokenization_neither_blocks_the_model_nor_outlives_its_client(
    engine: MlxTextEngine,
) -> None:
    """While a 1M-character prompt tokenizes, a small request to the same model is served; the long one's client leaves at once."""
    await collect(engine, completion("warm up", max_tokens=2))
    # ~1M characters (within the 65,536-token context's character bound), ~1.3 s to tokenize
    long_prompt = "hello world this is a tiny model, " * 30_000
    started = trio.Event()

    async def long_client() -> None:
        with trio.move_on_after(0.3) as scope:
            started.set()
            await collect(engine, completion(long_prompt, max_tokens=2))
        assert scope.cancelled_caught

    async with trio.open_nursery() as nursery:
        t_start = time.monotonic()
        nursery.start_soon(long_client)
        await started.wait()
        t0 = time.monotonic()
        _text, fin, _ = await collect(engine, completion("hello", max_tokens=4, temperature=0))
        small_took = time.monotonic() - t0
        assert fin.completion_tokens == 4
    # the long client left at its deadline, not when the tokenizer finished
    assert time.monotonic() - t_start < 1.0
    # the small request did not wait for the long prompt's tokenizing (~1.3 s)
    assert small_took < 0.5, small_took
    assert not any(st.prompt_tokens > 100_000 for st in engine.history)


MEMORY_SCRIPT = """
import json, sys
import trio
import mlx.core as mx
from mlxd.engines.mlx_text import MlxTextEngine
from tests.engines.mlx_helpers import collect, completion, tiny_config
from tests.support.engines import mlx_thread_drained

async def main():
    # the prompt cache is off: on, it keeps the request's KV on purpose (bounded by
    # prompt_cache_gb, which the model commits; see tests/engines/test_batching.py)
    engine = MlxTextEngine(tiny_config(sys.argv[1], prompt_cache_bytes=0))
    await engine.load(lambda _p: None)
    counters = lambda: (int(mx.get_active_memory()), int(mx.get_cache_memory()))
    await collect(engine, completion("warm up " * 20, max_tokens=8))
    before = await engine._thread.run(counters)
    _text, fin, _ = await collect(
        engine, completion("hello world this is a tiny model, " * 234, max_tokens=8))
    await mlx_thread_drained(engine)
    after = await engine._thread.run(counters)
    await engine.stop()
    print(json.dumps({"before": before, "after": after, "prompt_tokens": fin.prompt_tokens}))

trio.run(main)
"""


def test_memory_of_a_large_request_is_given_back(tiny_model_dir: Path) -> None:
    """After a 2,100-token request, MLX's buffer cache is empty and its active memory is what it was before (in a process of its own: the counters are process-wide)."""
    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tiny_model_dir)],
                          capture_output=True, text=True, cwd=REPO, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["prompt_tokens"] >= 2100
    (active_before, _), (active_after, cache_after) = got["before"], got["after"]
    assert cache_after == 0, got
    assert active_after == active_before, got


async def test_a_short_prompt_is_encoded_by_the_tokenizers_core_with_the_same_ids(
    engine: MlxTextEngine,
) -> None:
    """On the Trio thread a short prompt is encoded by the fast tokenizer's Rust core, which
    keeps the GIL (transformers' batch-of-one encode lets go of it): the same ids as the
    tokenizer's own encode on chats and completions; a core that disagrees on the probes is
    not used."""
    import tokenizers

    from mlxd.engines.base import ChatMessage, GenerationRequest
    from mlxd.engines.text import prompts

    tok = engine._tokenizer
    assert isinstance(prompts.in_place_core(tok), tokenizers.Tokenizer)
    special = " ".join(tok.all_special_tokens)
    texts = ["hello", f"{special} x{special}", "  é 🙂\t数字\n\n123 ", "a" * 3000]
    requests = [completion(t) for t in texts] + [chat(t) for t in texts] + [
        GenerationRequest(kind="chat", messages=(
            ChatMessage("system", "You are terse."), ChatMessage("user", t),
            ChatMessage("assistant", "ok"), ChatMessage("user", "again: " + t)))
        for t in texts
    ]
    for r in requests:
        ids = prompts.encode_prompt(tok, r, in_place=True)
        assert ids == prompts.encode_prompt(tok, r) and ids

    class Disagrees:  # a wrapper whose own encode adds a token its core does not
        def __init__(self) -> None:
            self._tokenizer = tok._tokenizer
            self.all_special_tokens = tok.all_special_tokens
            self.bos_token = tok.bos_token

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [0, *tok.encode(text, add_special_tokens=add_special_tokens)]

    odd = Disagrees()
    assert prompts.in_place_core(odd) is None
    assert prompts.encode_prompt(odd, completion("hello"), in_place=True)[0] == 0
