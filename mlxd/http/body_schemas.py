"""The JSON Schemas of every response body, generated from the ``TypedDict`` that describes it.

Each JSON body the daemon answers is described once, as a ``TypedDict`` in a
``bodies_*`` module of its family (:mod:`mlxd.http.bodies_openai`,
:mod:`~mlxd.http.bodies_admin`, :mod:`~mlxd.http.bodies_anthropic`,
:mod:`~mlxd.http.bodies_ollama`, :mod:`~mlxd.http.bodies_responses`). The code
that builds a body is annotated to return its ``TypedDict``, so ``mypy``
checks what the daemon sends against the description, and the OpenAPI
document's schemas are made from the same ``TypedDict`` by pydantic
(:func:`components`): a field added to a body reaches the document without a
second edit. Constraints a type cannot say (``minimum: 0``, a pattern) are
``Annotated`` on the field (:data:`NonNegative`); a docstring is its schema's
``description``.

Every ``TypedDict`` is one schema of ``components.schemas``, named as the
class is; the routes' responses point at them with :func:`ref`. Names are
unique across the families (a clash is an error here, not a silent overwrite).
Generated titles are dropped (the component's name says it). Objects are left
open (no ``additionalProperties``), as the hand-written schemas were: a client
must ignore fields it does not know.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from typing import Annotated, Any, cast

from pydantic import Field, TypeAdapter

#: a count or a size: an integer, 0 or more
NonNegative = Annotated[int, Field(ge=0)]

_PREFIX = "#/components/schemas/"


def ref(body: type | Any) -> dict[str, str]:
    """A response's schema: a reference to ``body``'s component."""
    return {"$ref": _PREFIX + _name(body)}


def event_data(*bodies: type | Any) -> dict[str, Any]:
    """What an SSE event's ``data`` holds: the JSON text of one of ``bodies``
    (``contentSchema`` points at their components)."""
    refs = [ref(body) for body in bodies]
    return {"contentMediaType": "application/json",
            "contentSchema": refs[0] if len(refs) == 1 else {"anyOf": refs}}


def _name(body: type | Any) -> str:
    name = getattr(body, "__name__", None)
    if not isinstance(name, str):
        raise TypeError(f"{body!r} has no name to be a component by")
    return name


def _untitled(schema: Any) -> Any:
    """``schema`` without pydantic's generated ``title``s (a property named ``title`` stays)."""
    if isinstance(schema, list):
        return [_untitled(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "$defs"):
            out[key] = {name: _untitled(s) for name, s in value.items()}
        else:
            out[key] = _untitled(value)
    return out


def generate(bodies: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """The component schemas of ``bodies`` and of every ``TypedDict`` they hold, by name."""
    bodies = tuple(bodies)
    # one adapter over all of them: every TypedDict becomes a definition, named once
    adapter: TypeAdapter[Any] = TypeAdapter(cast(Any, tuple)[bodies])
    schema = adapter.json_schema(ref_template=_PREFIX + "{model}", mode="serialization")
    defs: dict[str, dict[str, Any]] = _untitled(schema.get("$defs", {}))
    for body in bodies:
        name = _name(body)
        if name not in defs:
            raise ValueError(f"the body {name} did not become a component (a clash of names?)")
    clashed = [name for name in defs if "__" in name]
    if clashed:  # pydantic qualifies a name two classes share
        raise ValueError(f"two body types share a name: {clashed}")
    return defs


def bodies() -> tuple[Any, ...]:
    """Every response body: each family's ``BODIES``."""
    from mlxd.http import (
        bodies_admin,
        bodies_anthropic,
        bodies_ollama,
        bodies_openai,
        bodies_responses,
    )

    return (*bodies_openai.BODIES, *bodies_admin.BODIES, *bodies_anthropic.BODIES,
            *bodies_ollama.BODIES, *bodies_responses.BODIES)


@functools.cache
def _components() -> dict[str, dict[str, Any]]:
    return generate(bodies())


def components() -> dict[str, dict[str, Any]]:
    """Every response body's schema, by name (generated once; a fresh copy each call)."""
    return copy.deepcopy(_components())
