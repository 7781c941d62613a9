"""The Messages fields current clients (Claude Code) send beyond the basic ones.

Each reader takes the request body and returns what the engine request needs,
or raises :class:`~mlxd.errors.InvalidRequest` naming the field:

* :func:`thinking`: ``{"type": "enabled", "budget_tokens": N}``, ``{"type":
  "adaptive"}`` or ``{"type": "disabled"}`` -> the chat template's thinking
  switch (``enable_thinking``); without the field, off (Anthropic's default). A
  model whose template has no switch answers without thinking.
* :func:`output_format`: ``output_config.format`` (and the earlier top-level
  ``output_format``) ``{"type": "json_schema", "schema": {...}}`` -> the grammar
  constraint; ``output_config.effort`` is accepted (a local model has no effort
  knob).
* :func:`check_accepted`: ``context_management``, ``service_tier`` and
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
from mlxd.http.fields import Choice, bad, is_int, read
from mlxd.http.structured import check_schema

THINKING_TYPES = ("enabled", "adaptive", "disabled")
EFFORTS = ("low", "medium", "high", "max")
SERVICE_TIERS = ("auto", "standard_only")
SYSTEM_ROLES = ("system", "developer")
SERVICE_TIER = Choice(SERVICE_TIERS)
#: ``output_config``'s scalar field (``format`` is read by :func:`output_format`)
EFFORT = Choice(EFFORTS)


def is_system_role(role: object) -> bool:
    return role in SYSTEM_ROLES


def thinking(body: dict[str, Any]) -> bool:
    """Whether the model's template gets its thinking switch on."""
    v = body.get("thinking")
    if v is None:
        return False
    if not isinstance(v, dict) or v.get("type") not in THINKING_TYPES:
        raise bad("thinking", "must be {\"type\": \"enabled\" | \"adaptive\" | \"disabled\"}")
    if v["type"] == "enabled":
        budget = v.get("budget_tokens")
        if budget is not None and (not is_int(budget) or budget < 0):
            raise bad("thinking.budget_tokens", "must be a non-negative integer")
    return bool(v["type"] != "disabled")


def _format(v: object, param: str) -> Constraint | None:
    if v is None:
        return None
    if not isinstance(v, dict) or v.get("type") != "json_schema":
        raise bad(f"{param}.type", "must be 'json_schema' (with a 'schema')")
    schema = check_schema(v.get("schema"), f"{param}.schema")
    return Constraint("json_schema", json.dumps(schema), param=f"{param}.schema")


def output_format(body: dict[str, Any]) -> Constraint | None:
    """The grammar ``output_config.format`` (or ``output_format``) asks for, or None."""
    config = body.get("output_config")
    found: Constraint | None = None
    if config is not None:
        if not isinstance(config, dict):
            raise bad("output_config", "must be an object ({\"effort\", \"format\"})")
        read(config, "effort", EFFORT, None, prefix="output_config.")
        found = _format(config.get("format"), "output_config.format")
    legacy = _format(body.get("output_format"), "output_format")
    if found is not None and legacy is not None:
        raise bad("output_format", "give the format once, in output_config.format")
    return found or legacy


def check_accepted(body: dict[str, Any]) -> None:
    """Shape checks of the fields accepted and not used (module docstring)."""
    for key in ("metadata", "context_management"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise bad(key, "must be an object")
    edits = (body.get("context_management") or {}).get("edits")
    if edits is not None and not (isinstance(edits, list) and all(isinstance(e, dict) for e in edits)):
        raise bad("context_management.edits", "must be a list of objects")
    read(body, "service_tier", SERVICE_TIER, None)
