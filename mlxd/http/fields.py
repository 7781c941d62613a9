"""One description of each scalar request field: how the route reads it and how ``/openapi.json`` shows it.

A route lists its scalar fields in a table (``{"temperature": Number(0, 2), ...}``):
its validator reads each value with :func:`read` (absent or ``null``: the default;
anything else outside the description: a 400 naming the field) and
:mod:`mlxd.http.openapi` documents the same table with :func:`documented`, so a
field added to, or changed in, a table reaches the document without a second
edit. ``tests/unit/test_request_fields.py`` checks that each kind's check and
its JSON Schema agree value for value, and that each route's document shows
its table.

The kinds follow JSON Schema's rules where Python's differ: booleans are never
numbers, an integer may be written ``16.0``, and numbers are finite. Fields
whose shape is more than a scalar (messages, tools, formats) are described by
the composite kinds of :mod:`mlxd.http.shapes` built from these, which check a
whole body and give the document its request schema.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from mlxd.errors import InvalidRequest

T = TypeVar("T")


class Kind(Protocol):
    """What one field accepts: a complaint for a value it refuses, and its JSON Schema."""

    def complaint(self, v: object) -> str | None: ...

    def schema(self) -> dict[str, Any]: ...


def _finite_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_int(v: object) -> bool:
    """An integer as JSON Schema has it: ``16`` or ``16.0``, never ``true``."""
    if isinstance(v, float):
        return math.isfinite(v) and v.is_integer()
    return isinstance(v, int) and not isinstance(v, bool)


def _got(v: object) -> str:
    """`` (got 3)`` for a number out of bounds (other values, and huge integers, are not echoed)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return f" (got {v})" if -(10**18) < v < 10**18 else ""
    return f" (got {v:g})" if isinstance(v, float) and math.isfinite(v) else ""


@dataclass(frozen=True, slots=True)
class Number:
    lo: float
    hi: float

    def complaint(self, v: object) -> str | None:
        if _finite_number(v) and self.lo <= v <= self.hi:  # type: ignore[operator]
            return None
        return f"must be a number from {self.lo:g} to {self.hi:g}{_got(v)}"

    def schema(self) -> dict[str, Any]:
        return {"type": "number", "minimum": self.lo, "maximum": self.hi}


@dataclass(frozen=True, slots=True)
class Integer:
    lo: int | None = None
    hi: int | None = None
    #: what a refused value is told (else the bounds)
    hint: str | None = None

    def complaint(self, v: object) -> str | None:
        if is_int(v) and (self.lo is None or v >= self.lo) and (self.hi is None or v <= self.hi):  # type: ignore[operator]
            return None
        if self.hint is not None:
            return self.hint
        if self.lo is not None and self.hi is not None:
            return f"must be an integer from {self.lo} to {self.hi}{_got(v)}"
        return "must be an integer" + (f" >= {self.lo}" if self.lo is not None else "") + (
            f" <= {self.hi}" if self.hi is not None else "") + _got(v)

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "integer"}
        if self.lo is not None:
            out["minimum"] = self.lo
        if self.hi is not None:
            out["maximum"] = self.hi
        return out


@dataclass(frozen=True, slots=True)
class Boolean:
    def complaint(self, v: object) -> str | None:
        return None if isinstance(v, bool) else "must be a boolean"

    def schema(self) -> dict[str, Any]:
        return {"type": "boolean"}


@dataclass(frozen=True, slots=True)
class Text:
    min_length: int = 0
    max_length: int | None = None
    #: what a refused value is told (else the bounds)
    hint: str | None = None

    def complaint(self, v: object) -> str | None:
        if isinstance(v, str) and self.min_length <= len(v) and (
                self.max_length is None or len(v) <= self.max_length):
            return None
        if self.hint is not None:
            return self.hint
        if self.max_length is not None:
            return f"must be a string of {self.min_length} to {self.max_length} characters"
        return "must be a non-empty string" if self.min_length else "must be a string"

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "string"}
        if self.min_length:
            out["minLength"] = self.min_length
        if self.max_length is not None:
            out["maxLength"] = self.max_length
        return out


@dataclass(frozen=True, slots=True)
class Choice:
    values: tuple[str, ...]

    def complaint(self, v: object) -> str | None:
        return None if isinstance(v, str) and v in self.values else \
            f"must be one of {', '.join(self.values)}"

    def schema(self) -> dict[str, Any]:
        return {"enum": list(self.values)}


#: a stop string: 1 to 256 characters
MAX_STOP_LENGTH = 256


@dataclass(frozen=True, slots=True)
class Stops:
    """Stop strings: a list of at most ``most`` (or, ``one_string``, a single string)."""

    most: int
    one_string: bool = True

    def complaint(self, v: object) -> str | None:
        items = [v] if self.one_string and isinstance(v, str) else v
        if isinstance(items, list) and len(items) <= self.most and all(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_LENGTH for s in items):
            return None
        what = "a string or " if self.one_string else ""
        return f"must be {what}a list of at most {self.most} strings of 1 to {MAX_STOP_LENGTH} characters"

    def schema(self) -> dict[str, Any]:
        one = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH}
        many = {"type": "array", "items": one, "maxItems": self.most}
        return {"anyOf": [one, many]} if self.one_string else many


def bad(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param)


def read(body: Mapping[str, Any], key: str, kind: Kind, default: T, *, prefix: str = "") -> Any | T:
    """``body[key]`` as ``kind`` describes it, or ``default`` when absent or null; a 400
    naming ``prefix + key`` otherwise. Numbers come back as ``float``, integers as ``int``,
    stop strings as a tuple."""
    v = body.get(key)
    if v is None:
        return default
    problem = kind.complaint(v)
    if problem is not None:
        raise bad(prefix + key, problem)
    if isinstance(kind, Number):
        return float(v)
    if isinstance(kind, Integer):
        return int(v)
    if isinstance(kind, Stops):
        return (v,) if isinstance(v, str) else tuple(v)
    return v


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def documented(table: Mapping[str, Kind], notes: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The document's properties for ``table``: each field's schema, or ``null``; ``notes``
    add a description to some."""
    out = {key: nullable(kind.schema()) for key, kind in table.items()}
    for key, note in (notes or {}).items():
        out[key]["description"] = note
    return out
