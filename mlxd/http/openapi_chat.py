"""OpenAPI pieces of ``/v1/chat/completions`` requests: one variant per engine group.

Kept beside :mod:`mlxd.http.openapi`, which assembles the document (and
passes the model and ``keep_alive`` fields in). Each variant is the schema of
the validator's own description (:func:`mlxd.http.validation.chat_body`) for
what the group's engine accepts: mlx-lm text models take tools (when their
template has tool support, else 400 ``tools_not_supported``),
grammar-constrained ``response_format`` and logprobs; vision models take
images and none of these; fake engines take logprobs only. So generated
"valid" requests are valid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mlxd.http.openapi_clients import with_model
from mlxd.http.validation import chat_body

if TYPE_CHECKING:
    from mlxd.config import Config

#: the fields a request naming one of ``names`` adds to its body's description (model, keep_alive)
Named = Callable[[list[str]], dict[str, Any]]


#: what each engine group takes: (images, tools, grammar, logprobs)
_GROUPS = {"text": (False, True, True, True), "vision": (True, False, False, False),
           "fake": (False, False, False, True)}


def chat_request(groups: dict[str, list[str]], named: Named) -> dict[str, Any]:
    """One variant per engine group; a generic one without models."""
    def variant(names: list[str], kind: str) -> dict[str, Any]:
        images, tools, grammar, logprobs = _GROUPS[kind]
        body = chat_body(images=images, tools=tools, grammar=grammar, logprobs=logprobs)
        return with_model(body, named(names))

    return per_group(groups, variant)


def per_group(groups: dict[str, list[str]], variant: Callable[[list[str], str], dict[str, Any]]) -> dict[str, Any]:
    """The request schema: ``variant(names, group)`` for each group with models (a generic text
    one without any)."""
    variants = [variant(names, kind) for kind, names in groups.items() if names]
    if not variants:
        return variant([], "text")
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def engine_groups(config: Config | None) -> dict[str, list[str]]:
    """Model names by what their engine accepts (see the module docstring)."""
    models = list(config.models) if config is not None else []
    real = [m for m in models if m.engine_kind.constrains]  # the others: the "fake" group
    return {
        "text": [m.name for m in real if not m.mllm and not m.embedding],
        "vision": [m.name for m in real if m.mllm],
        "fake": [m.name for m in models if not m.engine_kind.constrains],
    }
