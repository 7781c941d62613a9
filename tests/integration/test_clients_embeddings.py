"""POST /v1/embeddings with the official `openai` client on a tiny random BERT (mlx-embeddings)."""

from __future__ import annotations

import base64
import struct
from pathlib import Path
from typing import Any

import openai
import pytest

from mlxd.engines.model_files.demo_model import BERT_SHAPE
from tests.integration.conftest import config_of
from tests.support.daemon import serving
from tests.support.official import openai_client as client
from tests.support.official import run

pytest.importorskip("mlx_embeddings", reason="the embeddings extra (mlx-embeddings) is not installed")


@pytest.fixture
def cfg(bert_model: Path, tiny_model: Path, tmp_path: Path) -> Any:
    return config_of(
        {"manager": {"memory_budget_gb": 2},
         "models": [{"name": "bert", "path": str(bert_model), "embedding": True,
                     "estimated_memory_gb": 0.01},
                    {"name": "tiny", "path": str(tiny_model), "estimated_memory_gb": 0.01}]},
        tmp_path,
    )


async def test_embeddings_of_strings_lists_and_token_ids(cfg: Any, tmp_path: Path) -> None:
    """Strings, lists and token ids embed to unit vectors; base64 decodes to the same floats; the lease row says /v1/embeddings."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        one = await run(lambda: c.embeddings.create(model="bert", input="hello world"))
        assert len(one.data) == 1 and len(one.data[0].embedding) == BERT_SHAPE["hidden_size"]
        assert abs(sum(x * x for x in one.data[0].embedding) - 1) < 1e-4
        many = await run(lambda: c.embeddings.create(model="bert", input=["hello world", "the quick fox"]))
        assert [d.index for d in many.data] == [0, 1]
        assert many.data[0].embedding == pytest.approx(one.data[0].embedding, abs=1e-5)
        assert many.usage.prompt_tokens == many.usage.total_tokens > one.usage.prompt_tokens
        ids = await run(lambda: c.embeddings.create(model="bert", input=[[2, 40, 41, 3], [2, 50, 3]]))
        assert len(ids.data) == 2 and ids.usage.prompt_tokens == 7
        async with s.client() as h:
            r = await h.post("/v1/embeddings", json={"model": "bert", "input": "hello world",
                                                     "encoding_format": "base64"})
        raw = base64.b64decode(r.json()["data"][0]["embedding"])
        floats = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert list(floats) == pytest.approx(one.data[0].embedding, abs=1e-6)
        await s.journal.wait_committed()
        assert {row["route"] for row in s.journal.leases(model="bert")} == {"/v1/embeddings"}


async def test_embedding_errors_name_the_field(cfg: Any, tmp_path: Path) -> None:
    """An input over the model's context, a generation model, and bad inputs each get a 400 naming the field."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        long = " ".join(["hello"] * (BERT_SHAPE["max_position_embeddings"] + 10))
        cases = [({"model": "bert", "input": ["ok", long]}, "input[1]"),
                 ({"model": "tiny", "input": "x"}, "model"),
                 ({"model": "bert", "input": []}, "input"),
                 ({"model": "bert", "input": [[1, -2]]}, "input[0]"),
                 ({"model": "bert", "input": "x", "dimensions": 3}, "dimensions")]
        for body, param in cases:
            with pytest.raises(openai.BadRequestError) as exc:
                await run(lambda body=body: c.embeddings.create(**body))
            assert exc.value.param == param, exc.value.body
        with pytest.raises(openai.BadRequestError) as chat:
            await run(lambda: c.chat.completions.create(
                model="bert", messages=[{"role": "user", "content": "x"}]))
        assert chat.value.param == "model"
