"""OpenAPI piece of ``POST /v1/embeddings`` (assembled by :mod:`mlxd.http.openapi`)."""

from __future__ import annotations

from typing import Any

from mlxd.http.bodies_openai import EmbeddingList
from mlxd.http.body_schemas import ref
from mlxd.http.embeddings_api import BODY
from mlxd.http.openapi_clients import ANY_MODEL_NAME, with_model


def embeddings_path(
    embedding_models: list[str], other_models: list[str], errors: dict[str, Any]
) -> dict[str, Any]:
    """``errors``: the route's error responses (OpenAI envelope), built by the caller.

    Without embedding models, any name but a configured one (which is a 400:
    not an embedding model) is valid and answered 404.
    """
    model: dict[str, Any] = (
        {"type": "string", "enum": embedding_models} if embedding_models
        else {**ANY_MODEL_NAME, "not": {"enum": other_models},
              "description": "an embedding: true model"})
    request = with_model(BODY, {"model": model})
    return {"/v1/embeddings": {"post": {
        "summary": "Embeddings of texts or token ids (embedding: true models)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {"200": {"description": "the vectors",
                              "content": {"application/json": {"schema": ref(EmbeddingList)}}}, **errors},
    }}}
