"""What crosses the pipe between the daemon and an engine worker, besides plain values.

Messages are tuples framed by :mod:`mlxd.framing`; the request and event
dataclasses of :mod:`mlxd.engines.base` and :class:`~mlxd.config.ModelConfig`
pickle as they are. Exceptions do not: an :class:`~mlxd.errors.MlxdError`
subclass may take other constructor arguments than its message, so errors
travel as ``(class name, message, param, retry_after)`` and are rebuilt here
as the same class, or as :class:`~mlxd.errors.EngineError` for anything else.

The messages (daemon -> worker):

* ``("load", ModelConfig, Rank | None)``: make the engine and load it;
* ``("cancel_load",)``: the load was abandoned: stop and exit;
* ``("prepare", rid, GenerationRequest)``: answered by ``("event", rid, request)``
  (prepared, without its ``logits_processors``: callables stay in the worker,
  whose engine builds them from the request's ``constraint``) or ``("error", rid, error)``;
* ``("count", rid, GenerationRequest)``: answered by ``("event", rid, n)`` (the prompt's
  tokens, as the engine's ``count_tokens``) or ``("error", rid, error)``;
* ``("generate", rid, GenerationRequest)`` and ``("cancel", rid)`` (of any);
* ``("stop",)``: stop the engine, answer ``stopped``, exit.

(worker -> daemon): ``("hello", pid)`` first; ``("progress", LoadProgress)``;
``("loaded", measured_bytes, memory_source)`` or ``("load_failed", error)``;
``("event", rid, TextDelta | Finished)`` and ``("error", rid, error)``;
``("stopped", error_text | None)``. End of input, either way, means the other
side is gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxd import errors
from mlxd.errors import EngineError, MlxdError, describe_error

WireError = tuple[str, str, "str | None", "float | None"]


@dataclass(frozen=True, slots=True)
class Rank:
    """A worker's place in a distributed group (``None`` for a model on one machine)."""

    rank: int
    size: int
    backend: str


def error_to_wire(e: BaseException, context: str) -> WireError:
    """An exception as it crosses the pipe (a foreign one becomes an engine error)."""
    if isinstance(e, MlxdError):
        return (type(e).__name__, e.message, e.param, e.retry_after)
    return ("EngineError", f"{context}: {describe_error(e)}", None, None)


def error_from_wire(wire: WireError) -> MlxdError:
    """The :class:`MlxdError` that :func:`error_to_wire` described, as its own class."""
    name, message, param, retry_after = wire
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, MlxdError)):
        cls = EngineError
    error = cls.__new__(cls)
    MlxdError.__init__(error, message, param=param, retry_after=retry_after)
    return error
