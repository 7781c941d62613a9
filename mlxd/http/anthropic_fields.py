"""The Messages fields current clients (Claude Code) send beyond the basic ones.

Their shapes are described here (:func:`fields_kinds`, checked with the whole
body by :func:`mlxd.http.anthropic_shapes.parse_messages`); each reader takes
the checked body and returns what the engine request needs, or raises
:class:`~mlxd.errors.InvalidRequest` naming the field:

* :func:`thinking`: ``{"type": "enabled", "budget_tokens": N}``, ``{"type":
  "adaptive"}`` or ``{"type": "disabled"}`` -> the chat template's thinking
  switch (``enable_thinking``); without the field, off (Anthropic's default). A
  model whose template has no switch answers without thinking.
* :func:`output_format`: ``output_config.format`` (and the earlier top-level
  ``output_format``) ``{"type": "json_schema", "schema": {...}}`` -> the grammar
  constraint; ``output_config.effort`` is accepted (a local model has no effort
  knob).
* :data:`ACCEPTED`: ``context_management``, ``service_tier`` and
  ``metadata`` checked for shape and otherwise not used (no server-side
  context editing or tiers here). Top-level fields mlxd does not know are
  ignored, as Anthropic's API ignores them.
* :func:`is_system_role`: ``system`` and ``developer`` messages inside
  ``messages``; the parser folds them into the system prompt, in order.
"""

from __future__ import annotations

import json
from typing import Any

from mlxd.engines.base import Constraint
from mlxd.http.fields import Choice, Integer, Kind, bad
from mlxd.http.shapes import Array, Obj, Tagged
from mlxd.http.structured import check_schema

EFFORTS = ("low", "medium", "high", "max")
SERVICE_TIERS = ("auto", "standard_only")
SYSTEM_ROLES = ("system", "developer")
SERVICE_TIER = Choice(SERVICE_TIERS)
#: ``output_config``'s scalar field (``format`` is read by :func:`output_format`)
EFFORT = Choice(EFFORTS)


def is_system_role(role: object) -> bool:
    return role in SYSTEM_ROLES


#: ``thinking``: the template's switch (the budget is not used: a local model has none)
THINKING = Tagged("type", {"enabled": Obj({"budget_tokens": Integer(0, hint="must be a non-negative integer")}),
                          "adaptive": Obj({}), "disabled": Obj({})})
#: ``output_config.format`` and the earlier ``output_format``: any JSON Schema object
FORMAT = Tagged("type", {"json_schema": Obj({"schema": Obj({}, hint="must be a JSON Schema object")},
                                            required=("schema",))})
#: the fields accepted, checked for shape and not used (module docstring)
ACCEPTED: dict[str, Kind] = {
    "metadata": Obj({}),
    "context_management": Obj({"edits": Array(Obj({}), hint="must be a list of objects", whole=True)}),
    "service_tier": SERVICE_TIER,
}


def fields_kinds(*, grammar: bool) -> dict[str, Kind]:
    """Claude Code's fields; without a grammar (the document's variant for fake engines), no
    format."""
    config = Obj({"effort": EFFORT, **({"format": FORMAT} if grammar else {})},
                 hint='must be an object ({"effort", "format"})')
    return {"thinking": THINKING, "output_config": config, **ACCEPTED,
            **({"output_format": FORMAT} if grammar else {})}


def thinking(body: dict[str, Any]) -> bool:
    """Whether the model's template gets its thinking switch on (``thinking`` checked against
    :data:`THINKING` by the caller)."""
    v = body.get("thinking")
    return v is not None and v["type"] != "disabled"


def _format(v: dict[str, Any] | None, param: str) -> Constraint | None:
    if v is None:
        return None
    schema = check_schema(v["schema"], f"{param}.schema")
    return Constraint("json_schema", json.dumps(schema), param=f"{param}.schema")


def output_format(body: dict[str, Any]) -> Constraint | None:
    """The grammar ``output_config.format`` (or ``output_format``) asks for, or None (both
    checked against :func:`fields_kinds` by the caller)."""
    found = _format((body.get("output_config") or {}).get("format"), "output_config.format")
    legacy = _format(body.get("output_format"), "output_format")
    if found is not None and legacy is not None:
        raise bad("output_format", "give the format once, in output_config.format")
    return found or legacy
