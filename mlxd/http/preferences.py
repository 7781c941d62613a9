"""What a request may ask of residency: ``keep_alive``, ``X-Mlxd-Contention``, ``X-Mlxd-Require-Resident``.

* ``keep_alive`` (a body field of the generation routes, or the header
  ``X-Mlxd-Keep-Alive``; the body wins when both are given), in Ollama's
  forms: a number of seconds (``300``), a Go duration string (``"5m"``,
  ``"1h30m"``, ``"90s"``, ``"500ms"``), ``0`` to unload the model as soon as
  the request ends, or any negative value (``-1``, ``"-1m"``) to keep it until
  it is evicted. A string of digits counts as seconds (headers carry strings);
  no spaces.
  The residency core clamps it by ``manager.max_keep_alive_s``.
* ``X-Mlxd-Contention``: a contention strategy (``fail``, ``wait``,
  ``wait_then_fail``, ``preempt``, ``wait_then_preempt``). The request gets at
  most its model's policy (:meth:`ContentionPolicy.at_most`): ``fail`` fails
  fast instead of waiting; nothing asks for more waiting or preemption.
* ``X-Mlxd-Require-Resident: 1`` (or ``true``; ``0``/``false`` = absent): serve
  only if the model is ``loaded`` now, else 503 ``model_not_resident``
  (``Retry-After: 0``) before any byte of the response, loading and queueing
  nothing: a router (:mod:`mlxd.fleet`) tries the daemons that hold the model first.

Each problem is a 400 :class:`~mlxd.errors.InvalidRequest` naming the field or header.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from mlxd.errors import InvalidRequest
from mlxd.residency.policy import STRATEGIES, ContentionPolicy

KEEP_ALIVE_HEADER = "X-Mlxd-Keep-Alive"
CONTENTION_HEADER = "X-Mlxd-Contention"
REQUIRE_RESIDENT_HEADER = "X-Mlxd-Require-Resident"
_FLAGS = {"1": True, "true": True, "0": False, "false": False}

_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DECIMAL = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_UNIT = r"(?:ns|us|µs|μs|ms|s|m|h)"
#: a keep_alive string: seconds (``300``) or a Go duration (``1h30m``), optionally signed
#: (also the pattern of the OpenAPI document, so both agree)
KEEP_ALIVE_PATTERN = rf"^[+-]?(?:{_DECIMAL}|(?:{_DECIMAL}{_UNIT})+)$"
_KEEP_ALIVE = re.compile(KEEP_ALIVE_PATTERN)
_PART = re.compile(rf"({_DECIMAL})({_UNIT})")


class Headers(Protocol):
    """A case-insensitive header lookup (Werkzeug's ``Headers``, or a plain dict in tests)."""

    def get(self, key: str) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Preferences:
    """What one request asked for (None: what its model's settings say)."""

    keep_alive_s: float | None = None
    contention: ContentionPolicy | None = None
    #: X-Mlxd-Require-Resident: refuse (model_not_resident) rather than load or wait for a load
    require_resident: bool = False


def _bad(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param)


def _seconds(text: str) -> float:
    """Seconds of a string that matches :data:`KEEP_ALIVE_PATTERN`."""
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
    parts = _PART.findall(body)
    if not parts:
        return sign * float(body)
    return sign * sum(float(n) * _UNIT_S[unit] for n, unit in parts)


def parse_keep_alive(value: object, param: str = "keep_alive") -> float | None:
    """Seconds from an Ollama ``keep_alive``: >= 0 as given, -1 for any negative value."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _bad(param, 'must be a number of seconds or a duration such as "5m" (-1: until evicted)')
    if isinstance(value, str):
        if not _KEEP_ALIVE.fullmatch(value):
            raise _bad(param, f'{value[:40]!r} is not a duration such as "5m", "1h30m", "90s" or 300')
        seconds = _seconds(value)
    else:
        try:
            seconds = float(value)
        except OverflowError:  # an integer past the float range (10**400)
            raise _bad(param, "must be finite") from None
    if not math.isfinite(seconds):
        raise _bad(param, "must be finite")
    return -1.0 if seconds < 0 else seconds


def parse_contention(value: str | None, param: str = CONTENTION_HEADER) -> ContentionPolicy | None:
    """The policy an ``X-Mlxd-Contention`` header (or the ``param`` given) asks for (None when absent)."""
    if value is None:
        return None
    if value not in STRATEGIES:
        raise _bad(param, f"must be one of {', '.join(STRATEGIES)} (got {value[:40]!r})")
    return ContentionPolicy.of(value)  # checked just above


def parse_require_resident(value: str | None) -> bool:
    """``X-Mlxd-Require-Resident``: ``1``/``true`` asks for it, ``0``/``false`` or absent does not."""
    if value is None:
        return False
    flag = _FLAGS.get(value)  # exactly the documented spellings (the OpenAPI enum)
    if flag is None:
        raise _bad(REQUIRE_RESIDENT_HEADER, f"must be 1, 0, true or false (got {value[:40]!r})")
    return flag


def preferences(body: Mapping[str, object], headers: Headers) -> Preferences:
    """A request's preferences from its JSON body and headers (see the module doc)."""
    # the header is checked even when the body's keep_alive wins: a bad value is a 400 either way
    header = parse_keep_alive(headers.get(KEEP_ALIVE_HEADER), KEEP_ALIVE_HEADER)
    keep_alive = parse_keep_alive(body.get("keep_alive"))
    if keep_alive is None:
        keep_alive = header
    return Preferences(
        keep_alive,
        parse_contention(headers.get(CONTENTION_HEADER)),
        parse_require_resident(headers.get(REQUIRE_RESIDENT_HEADER)),
    )
