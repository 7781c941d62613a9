"""The words of the residency core's refusals: one function per typed error it raises.

Kept apart from :mod:`mlxd.residency.core` so the scheduling code reads as
decisions, and so every message that names bytes uses :func:`mlxd.units.format_bytes`.
"""

from __future__ import annotations

from mlxd.errors import CapacityTimeout, Conflict, ModelCapacity, ModelExceedsBudget
from mlxd.units import format_bytes


def exceeds_budget(model: str, need: int, budget: int) -> ModelExceedsBudget:
    return ModelExceedsBudget(
        f"'{model}' needs {format_bytes(need)}, more than the whole "
        f"memory budget of {format_bytes(budget)}",
        param="model",
    )


def no_room(model: str, need: int, committed: int, budget: int) -> ModelCapacity:
    return ModelCapacity(
        f"'{model}' ({format_bytes(need)}) does not fit: {format_bytes(committed)} of "
        f"{format_bytes(budget)} are committed to models in use"
    )


def model_leaving(model: str, state: str, retry_at: float | None, now: float) -> ModelCapacity:
    """``fail``: the model itself is on its way out (a drain, or a stop that keeps failing)."""
    if retry_at is not None:
        wait = max(1.0, retry_at - now)
        return ModelCapacity(
            f"'{model}' cannot be loaded now: stopping its engine failed, and the "
            f"stop is retried in {wait:.0f} s",
            retry_after=wait,
        )
    return ModelCapacity(
        f"'{model}' is being unloaded ({state}); the 'fail' strategy does not wait for it"
    )


def waited_too_long(
    model: str, waited_s: float, wait_timeout_s: float | None, *, kv: int = 0
) -> CapacityTimeout:
    what = f"{format_bytes(kv)} of KV for a request on '{model}'" if kv else f"room to load '{model}'"
    return CapacityTimeout(f"waited {waited_s:.0f} s for {what} (wait_timeout_s={wait_timeout_s})")


def kv_exceeds_budget(model: str, need: int, room: int, budget: int) -> ModelExceedsBudget:
    """A request whose KV could not fit even with every other model evicted (400)."""
    return ModelExceedsBudget(
        f"the request's KV cache on '{model}' needs {format_bytes(need)} more; with every other "
        f"model evicted the {format_bytes(budget)} memory budget leaves {format_bytes(room)} "
        f"for it, {format_bytes(need - room)} short: shorten the prompt or lower max_tokens",
        param="messages",
    )


def kv_no_room(model: str, need: int, committed: int, budget: int) -> ModelCapacity:
    return ModelCapacity(
        f"the request's KV cache on '{model}' ({format_bytes(need)}) does not fit now: "
        f"{format_bytes(committed)} of {format_bytes(budget)} are committed to models in use"
    )


def kv_without_lease(model: str) -> Conflict:
    return Conflict(f"KV for '{model}' is asked for by a request that holds no lease on it")


def live_models_in_reload(live: list[tuple[str, str]]) -> Conflict:
    return Conflict(
        "cannot remove or replace a live model: " + ", ".join(f"{n} ({s})" for n, s in live)
    )


def budget_below_committed(budget: int, committed: int) -> Conflict:
    return Conflict(
        f"the new budget ({format_bytes(budget)}) is below the memory committed now "
        f"({format_bytes(committed)}); unload models first"
    )
