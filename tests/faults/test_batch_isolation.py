"""A request's failure is its own: random mixes of good and poisoned requests in one batch.

On the tiny demo model at temperature 0 (a batched engine, up to 4 sequences
a step), each mix runs good requests (plain, and constrained by a JSON
grammar) next to poisoned ones: a schema the grammar cannot enforce, and
requests that raise in their own logits processor, sampler, detokenizer or
stop matching at a random token (:meth:`mlxd.engines.injected_faults.Faults.poison`).
Every good request must finish with exactly the token ids it gets when it
runs alone; every poisoned one must end with its own error, bounded in size.
The default suite runs a few small mixes; ``--stress`` runs many larger ones.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import trio

from mlxd.engines.base import ChatMessage, Constraint, Finished, GenerationRequest, TextDelta
from mlxd.engines.injected_faults import POISON_POINTS, Faults
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.errors import EngineError, InvalidRequest, MlxdError
from tests.engines.mlx_helpers import tiny_config

pytestmark = pytest.mark.mlx

#: a schema with no finite instance: the object requires a property of its own type
ENDLESS_OBJECT = {"$defs": {"n": {"type": "object", "required": ["c"],
                                  "properties": {"c": {"$ref": "#/$defs/n"}}}},
                  "$ref": "#/$defs/n"}
#: an array of itself that must hold at least one item
ENDLESS_ARRAY = {"type": "array", "minItems": 1, "items": {"$ref": "#"}}
WORDS = ["alpha", "river", "stone", "cloud", "ember", "maple", "orbit", "quartz", "delta", "lumen"]


@dataclass(frozen=True)
class Outcome:
    """What a request ended with: its token ids and finish reason, or its error."""

    ids: tuple[int, ...] = ()
    finish: str | None = None
    error: MlxdError | None = None


@pytest.fixture
async def engine(tiny_model: Path) -> AsyncIterator[MlxTextEngine]:
    eng = MlxTextEngine(tiny_config(tiny_model, max_batch_size=4), prefill_step=16,
                        faults=Faults("tiny", None))
    await eng.load(lambda _p: None)
    try:
        yield eng
    finally:
        await eng.stop()


def request(rid: str, prompt: str, *, constrained: bool, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        kind="chat", messages=(ChatMessage("user", prompt),), temperature=0.0,
        max_tokens=max_tokens, logprobs=0, request_id=rid,
        constraint=Constraint("json_object") if constrained else None,
    )


async def run(eng: MlxTextEngine, req: GenerationRequest, started: trio.Event | None = None) -> Outcome:
    """``req`` to its end; ``started`` is set at its first token."""
    ids: list[int] = []
    try:
        async for ev in eng.generate(req):
            if isinstance(ev, TextDelta):
                ids.extend(lp.id for lp in ev.logprobs)
                if started is not None:
                    started.set()
            elif isinstance(ev, Finished):
                return Outcome(tuple(ids), ev.finish_reason)
    except MlxdError as e:
        return Outcome(tuple(ids), error=e)
    raise AssertionError("the generation ended without Finished")


async def alone(eng: MlxTextEngine, req: GenerationRequest, cache: dict[str, Outcome]) -> Outcome:
    """What ``req`` gives when nothing else runs (the reference), once per prompt and kind."""
    key = f"{req.constraint is not None}:{req.max_tokens}:{req.messages[0].content}"
    if key not in cache:
        cache[key] = await run(eng, replace(req, request_id=None))
        assert cache[key].error is None, cache[key].error
    return cache[key]


async def mix(eng: MlxTextEngine, rng: random.Random, size: int, cache: dict[str, Outcome]) -> None:
    """One random mix of good and poisoned requests, all at once; each checked (module docstring)."""
    assert eng.faults is not None
    reqs: list[GenerationRequest] = []
    poisoned: dict[str, str] = {}  # request id -> what poisons it
    for i in range(size):
        rid = f"r{rng.randrange(10**9)}-{i}"
        prompt = " ".join(rng.sample(WORDS, 3))
        kind = rng.choice(["good", "good", "grammar", *POISON_POINTS])
        req = request(rid, prompt, constrained=kind == "logits" or rng.random() < 0.3,
                      max_tokens=rng.randint(4, 12))
        if kind == "grammar":
            schema = rng.choice([ENDLESS_OBJECT, ENDLESS_ARRAY])
            req = replace(req, constraint=Constraint("json_schema", json.dumps(schema)))
        elif kind != "good":
            ref = await alone(eng, req, cache)
            eng.faults.poison(rid, kind, at_token=rng.randint(1, len(ref.ids) or 1))  # type: ignore[arg-type]
        if kind != "good":
            poisoned[rid] = kind
        reqs.append(req)
    refs = {r.request_id: await alone(eng, r, cache) for r in reqs if r.request_id not in poisoned}
    got: dict[str, Outcome] = {}

    async def one(r: GenerationRequest) -> None:
        assert r.request_id is not None
        got[r.request_id] = await run(eng, r)

    async with trio.open_nursery() as n:
        for r in reqs:
            n.start_soon(one, r)
    for rid, out in got.items():
        if rid in poisoned:
            kind = poisoned[rid]
            assert out.error is not None, f"{kind} poison did not end {rid}: {out}"
            assert len(out.error.message) < 600, out.error.message
            if kind == "grammar":
                assert isinstance(out.error, InvalidRequest)
                assert out.error.param == "response_format.json_schema.schema"
            else:
                assert isinstance(out.error, EngineError)
                assert f"injected failure of the {kind}" in out.error.message
        else:
            assert out == refs[rid], f"{rid} in a batch with {sorted(poisoned.values())}"


@pytest.mark.parametrize("seed", [1, 2])
async def test_poisoned_requests_fail_alone(engine: MlxTextEngine, seed: int) -> None:
    """In random mixes, each poisoned request gets its own error and each good one its tokens alone."""
    rng = random.Random(seed)
    cache: dict[str, Outcome] = {}
    for _ in range(2):
        await mix(engine, rng, 6, cache)


@pytest.mark.stress
async def test_poisoned_requests_fail_alone_many_mixes(engine: MlxTextEngine) -> None:
    """The same promise over many larger mixes (queued behind full batches, solo handovers)."""
    rng = random.Random(32)
    cache: dict[str, Outcome] = {}
    for _ in range(40):
        await mix(engine, rng, rng.randint(4, 12), cache)


@pytest.mark.parametrize("schema", [ENDLESS_OBJECT, ENDLESS_ARRAY], ids=["object", "array"])
async def test_endless_schema_is_refused_before_admission_and_batch_goes_on(
    engine: MlxTextEngine, schema: dict[str, object]
) -> None:
    """A schema with no finite instance is a 400 naming the field while three streams run on unharmed."""
    good = [request(f"g{i}", f"{WORDS[i]} {WORDS[i + 1]}", constrained=False, max_tokens=24)
            for i in range(3)]
    cache: dict[str, Outcome] = {}
    refs = [await alone(engine, r, cache) for r in good]
    bad = replace(request("bad", "hello", constrained=False, max_tokens=24),
                  constraint=Constraint("json_schema", json.dumps(schema)))
    got: list[Outcome] = [Outcome()] * 3
    refused: list[MlxdError] = []
    started = [trio.Event() for _ in range(3)]

    async def stream(i: int) -> None:
        got[i] = await run(engine, good[i], started[i])

    async with trio.open_nursery() as n:
        for i in range(3):
            n.start_soon(stream, i)
        for ev in started:  # the three streams are under way
            await ev.wait()
        out = await run(engine, bad)
        assert out.error is not None
        refused.append(out.error)
    assert got == refs
    (err,) = refused
    assert isinstance(err, InvalidRequest) and err.http_status == 400
    assert err.param == "response_format.json_schema.schema"
    assert "no finite instance" in err.message and len(err.message) < 400


async def test_grammar_the_parser_gives_up_on_ends_its_request_alone(engine: MlxTextEngine) -> None:
    """A grammar that passes the static checks but that the parser gives up on while decoding
    ends its request alone, with a bounded 400 naming the field; the batch goes on."""
    from llguidance import LLMatcher

    from mlxd.engines.grammar.constrained import GrammarProcessor, grammar_tokens

    tokens = grammar_tokens(engine._tokenizer, engine._vocab_size)
    grammar = LLMatcher.grammar_from_json_schema(
        {**ENDLESS_ARRAY, "x-guidance": {"whitespace_flexible": False}})
    processor = GrammarProcessor(tokens, grammar, 24, param="response_format")
    bad = replace(request("bad", "hello", constrained=True, max_tokens=24),
                  logits_processors=(processor,))
    good = [request(f"g{i}", f"{WORDS[i]} {WORDS[i + 2]}", constrained=i == 0, max_tokens=16)
            for i in range(3)]
    cache: dict[str, Outcome] = {}
    refs = [await alone(engine, r, cache) for r in good]
    got: dict[str, Outcome] = {}

    async def one(r: GenerationRequest) -> None:
        assert r.request_id is not None
        got[r.request_id] = await run(engine, r)

    async with trio.open_nursery() as n:
        for r in [*good, bad]:
            n.start_soon(one, r)
    assert [got[r.request_id or ""] for r in good] == refs
    err = got["bad"].error
    assert isinstance(err, InvalidRequest) and err.param == "response_format"
    assert "Too many items" in err.message and len(err.message) < 500, err.message
