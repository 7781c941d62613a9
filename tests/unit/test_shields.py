"""Every shield in mlxd has a deadline: a shielded scope without one can hold a shutdown forever.

The package is parsed (not imported) and each shield is checked where it is
written. A shield counts as bounded when its scope gets a deadline in the same
place: ``with trio.move_on_after(N) as s: s.shield = True`` (or ``fail_after``,
``move_on_at``, ``fail_at``), ``trio.CancelScope(shield=True, deadline=...)``,
``with trio.CancelScope(shield=True) as s:`` whose body sets ``s.deadline``
first, or a shielded ``CancelScope`` whose ``with`` also enters a
``move_on_after``/``fail_after`` inside it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "mlxd"
TIMEOUTS = {"move_on_after", "fail_after", "move_on_at", "fail_at"}


def _name(call: ast.expr) -> str | None:
    if not isinstance(call, ast.Call):
        return None
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _shielded_scope(call: ast.expr) -> bool:
    return _name(call) == "CancelScope" and any(
        k.arg == "shield" and _is_true(k.value) for k in call.keywords  # type: ignore[attr-defined]
    )


def _has_deadline(call: ast.expr) -> bool:
    return any(k.arg == "deadline" for k in call.keywords)  # type: ignore[attr-defined]


def _sets_deadline_first(body: list[ast.stmt], scope: str) -> bool:
    first = body[0]
    return isinstance(first, ast.Assign) and any(
        isinstance(t, ast.Attribute) and t.attr == "deadline"
        and isinstance(t.value, ast.Name) and t.value.id == scope
        for t in first.targets
    )


def unbounded_shields(source: str) -> list[int]:
    """The lines of ``source`` that shield a cancel scope without bounding it."""
    tree = ast.parse(source)
    bounded_names: set[tuple[int, str]] = set()  # (line of the with, name) of timeout scopes
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if isinstance(item.optional_vars, ast.Name) and (
                    _name(item.context_expr) in TIMEOUTS
                    or (_name(item.context_expr) == "CancelScope" and _has_deadline(item.context_expr))
                ):
                    bounded_names.add((node.lineno, item.optional_vars.id))
    bad: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            timeout_inside = any(_name(i.context_expr) in TIMEOUTS for i in node.items)
            for i, item in enumerate(node.items):
                call = item.context_expr
                if not _shielded_scope(call) or _has_deadline(call):
                    continue
                later = node.items[i + 1:]
                if timeout_inside and any(_name(x.context_expr) in TIMEOUTS for x in later):
                    continue
                var = item.optional_vars
                if isinstance(var, ast.Name) and _sets_deadline_first(node.body, var.id):
                    continue
                bad.append(call.lineno)
        elif isinstance(node, ast.Call) and _shielded_scope(node) and not _has_deadline(node):
            if not any(node is item.context_expr for w in ast.walk(tree)
                       if isinstance(w, (ast.With, ast.AsyncWith)) for item in w.items):
                bad.append(node.lineno)  # a shielded scope made outside a with
        elif isinstance(node, ast.Assign) and _is_true(node.value):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and t.attr == "shield":
                    scope = t.value.id if isinstance(t.value, ast.Name) else None
                    if scope is None or not _bound_by_enclosing_with(tree, node, scope, bounded_names):
                        bad.append(node.lineno)
    return sorted(bad)


def _bound_by_enclosing_with(
    tree: ast.AST, assign: ast.Assign, scope: str, bounded: set[tuple[int, str]]
) -> bool:
    return any(
        isinstance(node, (ast.With, ast.AsyncWith)) and (node.lineno, scope) in bounded
        and any(assign is n for n in ast.walk(node))
        for node in ast.walk(tree)
    )


def test_every_shield_in_the_package_has_a_deadline() -> None:
    """No module of mlxd shields a cancel scope without a deadline written with it."""
    found = {
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in unbounded_shields(path.read_text())
    }
    assert found == set(), found


def test_the_check_tells_bounded_shields_from_unbounded_ones() -> None:
    """The check flags each unbounded form and passes each bounded one (it can fail)."""
    unbounded = [
        "with trio.CancelScope(shield=True):\n    pass\n",
        "with trio.CancelScope() as s:\n    s.shield = True\n",
        "scope = trio.CancelScope(shield=True)\n",
        "with trio.CancelScope(shield=True) as s:\n    await f()\n    s.deadline = 1\n",
        "with trio.move_on_after(1), trio.CancelScope(shield=True):\n    pass\n",
    ]
    bounded = [
        "with trio.move_on_after(5) as s:\n    s.shield = True\n",
        "with trio.fail_at(t) as s:\n    s.shield = True\n",
        "with trio.CancelScope(shield=True, deadline=d):\n    pass\n",
        "with trio.CancelScope(shield=True) as s:\n    s.deadline = d\n    await f()\n",
        "with trio.CancelScope(shield=True), trio.move_on_after(5):\n    pass\n",
    ]
    for source in unbounded:
        assert unbounded_shields(source) != [], source
    for source in bounded:
        assert unbounded_shields(source) == [], source
