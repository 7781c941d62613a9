"""Structured output that finishes: JSON the budget guard closed in time ends ``stop``.

On the demo config at the default ``max_tokens``, the random demo model writes
JSON strings until the guard closes them; the guard acts only when the tokens
left come down to what closing needs, so the answer is complete (``stop``,
``end_turn``) and the official clients' parsers accept it. ``--stress`` sends
the acceptance counts (100 of each); the default run sends 10.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pydantic
import pytest

from mlxd.config import Config
from tests.integration.test_clients_openai import PERSON, each_seed
from tests.support.daemon import serving
from tests.support.official import anthropic_client, openai_client, run

pytestmark = pytest.mark.mlx

ASK = [{"role": "user", "content": "describe a person"}]


class Person(pydantic.BaseModel):
    name: str
    age: int
    tags: list[str]
    role: Literal["admin", "user"]


def count(stress: bool) -> int:
    return 100 if stress else 10


async def test_json_schema_answers_end_stop_and_validate(demo: Config, tmp_path: Path, stress: bool) -> None:
    """Every json_schema answer at the default max_tokens ends 'stop' and validates against its schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reasons: list[str] = []
    async with serving(demo, tmp_path) as s:
        c = openai_client(s)

        def check(seed: int) -> None:
            r = c.chat.completions.create(model="demo", messages=ASK, seed=seed, response_format=fmt)
            reasons.append(r.choices[0].finish_reason)
            jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)

        await each_seed(count(stress), check)
    assert reasons == ["stop"] * count(stress)


async def test_parse_succeeds_at_the_default_max_tokens(demo: Config, tmp_path: Path, stress: bool) -> None:
    """chat.completions.parse with a pydantic model succeeds (no LengthFinishReasonError) every time."""
    async with serving(demo, tmp_path) as s:
        c = openai_client(s)

        def check(seed: int) -> None:
            r = c.chat.completions.parse(model="demo", messages=ASK, seed=seed, response_format=Person)
            assert isinstance(r.choices[0].message.parsed, Person)

        await each_seed(count(stress), check)


async def test_json_the_limit_cut_ends_length(demo: Config, tmp_path: Path) -> None:
    """A max_tokens too small to close the JSON ends 'length' (and parse() says so)."""
    import openai

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    async with serving(demo, tmp_path) as s:
        c = openai_client(s)
        r = await run(lambda: c.chat.completions.create(model="demo", messages=ASK, max_tokens=4,
                                                        seed=1, response_format=fmt))
        assert r.choices[0].finish_reason == "length"
        with pytest.raises(openai.LengthFinishReasonError):
            await run(lambda: c.chat.completions.parse(model="demo", messages=ASK, max_tokens=4,
                                                       seed=1, response_format=Person))


async def test_langchain_with_structured_output(demo: Config, tmp_path: Path) -> None:
    """LangChain's ChatOpenAI.with_structured_output (its default method) returns the pydantic model."""
    langchain_openai = pytest.importorskip("langchain_openai")
    async with serving(demo, tmp_path) as s:
        llm = langchain_openai.ChatOpenAI(model="demo", base_url=s.url + "/v1", api_key="unused",
                                          max_retries=0, seed=3)
        structured = llm.with_structured_output(Person)
        for i in range(3):
            out = await run(lambda i=i: structured.invoke(f"describe person {i}"))
            assert isinstance(out, Person)


async def test_anthropic_output_config_format_is_enforced(demo: Config, tmp_path: Path) -> None:
    """output_config.format json_schema gives JSON valid against the schema ending end_turn, whole and streamed."""
    fmt = {"effort": "low", "format": {"type": "json_schema", "schema": PERSON}}
    async with serving(demo, tmp_path) as s:
        c = anthropic_client(s)
        for _ in range(3):
            m = await run(lambda: c.messages.create(model="demo", max_tokens=512, messages=ASK,
                                                    extra_body={"output_config": fmt}))
            assert m.stop_reason == "end_turn"
            jsonschema.validate(json.loads(m.content[0].text), PERSON)

        def streamed() -> Any:
            with c.messages.stream(model="demo", max_tokens=512, messages=ASK,
                                   extra_body={"output_config": fmt}) as st:
                return st.get_final_message()

        final = await run(streamed)
        assert final.stop_reason == "end_turn"
        jsonschema.validate(json.loads(final.content[0].text), PERSON)
