"""``POST /v1/embeddings``: OpenAI's embeddings route for ``embedding: true`` models.

The same residency, budget, leases and journal as any model (the lease row's
route is ``/v1/embeddings``; its prompt tokens are the tokens embedded).
``input`` is a string, a list of strings, a list of token ids, or a list of
such lists; ``encoding_format`` ``float`` (default) or ``base64``
(little-endian float32, as OpenAI sends it). ``dimensions`` is accepted only
when it is the model's own size (these models cannot shorten their vectors).
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from quart import Blueprint, request

from mlxd.engines.text.prompt_limits import check_chars, limits_for
from mlxd.errors import InvalidRequest, ModelNotFound, ShuttingDown
from mlxd.http import generation
from mlxd.http.bodies_openai import EmbeddingList
from mlxd.http.context import state
from mlxd.http.fields import Choice, Integer, Kind, Text, bad, is_int, read
from mlxd.http.openai_api import read_json_body, request_id
from mlxd.http.preferences import Preferences, preferences
from mlxd.http.shapes import AnyOf, Array, Obj, check
from mlxd.http.structured import is_model_name

bp = Blueprint("embeddings", __name__)

MAX_INPUTS = 2048
MAX_TOKEN_ID = 2**31 - 1


#: the scalar fields of an embeddings body (read here, documented from this table)
FIELDS: dict[str, Kind] = {"encoding_format": Choice(("float", "base64")),
                           "dimensions": Integer(1, hint="must be a positive integer"),
                           "user": Text()}
_IDS = Array(Integer(0, MAX_TOKEN_ID), min_items=1, whole=True,
             hint=f"must be a non-empty list of token ids from 0 to {MAX_TOKEN_ID}")
#: texts to embed (also Ollama's ``/api/embed`` input)
TEXTS = AnyOf((Text(1), Array(Text(1), 1, MAX_INPUTS)),
              hint=f"must be a string or a list of 1 to {MAX_INPUTS} strings")
#: an embeddings body but its model (named by :func:`parse_embeddings`)
BODY = Obj({
    "input": AnyOf((*TEXTS.options, _IDS, Array(_IDS, 1, MAX_INPUTS)),
                   hint=f"must be a string, token ids, or a list of 1 to {MAX_INPUTS} strings "
                   "or token-id lists"),
    **FIELDS,
}, required=("input",), hint="the request body must be a JSON object", notes={
    "input": "over the model's context: 400 naming input[i]", "dimensions": "only the model's own size"})


def parse_input(v: str | list[Any]) -> list[str] | list[list[int]]:
    """The inputs (checked against :data:`BODY`) as texts or as token-id lists."""
    if isinstance(v, str):
        return [v]
    if isinstance(v[0], str):
        return list(v)
    return [[int(t) for t in seq] for seq in ([v] if is_int(v[0]) else v)]


def parse_embeddings(body: object) -> tuple[str, list[str] | list[list[int]], str, int | None]:
    """A ``/v1/embeddings`` body: (model, inputs, encoding_format, dimensions)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not is_model_name(model):
        raise bad("model", "is required: a non-empty string")
    check(BODY, body)
    inputs = parse_input(body["input"])
    fmt = read(body, "encoding_format", FIELDS["encoding_format"], "float")
    dims = read(body, "dimensions", FIELDS["dimensions"], None)
    return model, inputs, fmt, dims


def encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def embed_under_lease(
    model: str, inputs: list[str] | list[list[int]], prefs: Preferences, dims: int | None = None,
) -> tuple[list[Any], int, float]:
    """The vectors of ``inputs`` and their token count under a lease on the embedding model
    ``model``, and ``time.monotonic()`` when the lease was had; for every embeddings route
    (OpenAI's and Ollama's). An input too long by its length alone is refused before the
    lease, so no model is loaded for it; ``dims`` other than the model's width is a 400."""
    st = state()
    mc = st.config.model(model)
    if mc is None or not mc.embedding:
        raise bad("model", f"'{model}' is not an embedding model (set embedding: true in its config)")
    limits = limits_for(mc)  # before the lease and any tokenizing (mlxd.engines.text.prompt_limits)
    for i, x in enumerate(inputs):
        check_chars(model, len(x) if isinstance(x, str) else 0, limits, f"input[{i}]")
    lease = await generation.acquire(st, model, request_id(), prefs)
    lease_at = time.monotonic()
    async with lease:  # ends with the one outcome rule (mlxd.residency.lease.outcome_of)
        with lease.scope():
            vectors, tokens = await lease.engine.embed(inputs)  # type: ignore[attr-defined]
        if dims is not None and vectors and dims != len(vectors[0]):
            raise bad("dimensions", f"this model's vectors have {len(vectors[0])} dimensions")
        lease.set_usage(tokens, 0)
    return vectors, tokens, lease_at


@bp.post("/v1/embeddings")
async def embeddings() -> EmbeddingList:
    st = state()
    if st.draining:
        raise ShuttingDown("mlxd is shutting down")
    model, inputs, fmt, dims = parse_embeddings(await read_json_body())
    if not st.manager.has_model(model):
        raise ModelNotFound(model)
    # X-Mlxd-Keep-Alive, X-Mlxd-Contention, X-Mlxd-Require-Resident
    vectors, tokens, _ = await embed_under_lease(model, inputs, preferences({}, request.headers),
                                                 dims)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode(v, fmt)}
                 for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
