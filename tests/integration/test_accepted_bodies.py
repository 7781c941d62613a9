"""Bodies the Open API document allows get an answer, never a 400 or a 500.

A field that is null where the document allows null, or that a route does
not use, is no reason to refuse the request. Schemathesis found each of
these cases with a random seed (positive_data_acceptance, or a 500). They
are kept here so that every run covers them, whatever seed it draws.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxd.config import Config
from tests.integration.conftest import config_of, fake
from tests.support.daemon import serving

MODEL = "alpha-text"
HI = [{"role": "user", "content": "hi"}]

#: (label, route, body): each must be answered 200
ACCEPTED: list[tuple[str, str, dict[str, Any]]] = [
    ("count_tokens ignores max_tokens", "/v1/messages/count_tokens",
     {"model": MODEL, "messages": HI, "max_tokens": {"not": "a number"}}),
    ("completion with null chat fields", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "max_tokens": 4,
      "tools": None, "tool_choice": None, "response_format": None}),
    ("assistant message with a null tool_call_id", "/v1/chat/completions",
     {"model": MODEL, "max_tokens": 4,
      "messages": [*HI, {"role": "assistant", "content": "yo", "tool_call_id": None},
                   {"role": "user", "content": "again"}]}),
]


def config(tmp: Path) -> Config:
    return config_of(
        {
            "manager": {"memory_budget_gb": 8, "contention_policy": {"strategy": "fail"}},
            "models": [fake(MODEL, 1, load_seconds=0.01, tokens_per_second=5000)],
        },
        tmp,
    )


async def test_bodies_the_document_allows_are_answered(tmp_path: Path) -> None:
    """Fields that are null, or that a route does not use, get a 200 on every route."""
    async with serving(config(tmp_path), tmp_path) as served, served.client() as client:
        for label, path, body in ACCEPTED:
            response = await client.post(path, json=body)
            assert response.status_code == 200, (label, response.text[:300])
