"""No module of ``mlxd/`` reads another module's underscore attributes.

The rule, checked on the syntax tree of every module (``ast``, nothing imported):

* ``from X import _name`` is reach: a private name belongs to the module that
  defines it.
* ``obj._name`` (one leading underscore, not a dunder) is reach unless ``obj`` is
  ``self``, ``cls`` or ``super()``, or the module itself defines ``_name``: as a
  module-level name, a class attribute or method, or an attribute it assigns
  (``self._name = ...``). A module may touch the privates of what it defines (one
  instance of its class reading another's, a hub feeding the subscriptions of its
  own module); a private name it does not define belongs to some other module
  (``manager._release`` from ``lease.py``, ``journal._subscribers`` from
  ``subscription.py``) or to a third-party package.

What one module needs of another is a public method, a small ``Protocol`` or a
frozen snapshot instead. The few third-party privates mlxd cannot do without are
allowed below, each by module and expression, with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mlxd

PACKAGE = Path(mlxd.__file__).parent

#: (module file name, the expression as written) -> why it cannot be avoided. By file
#: name, not path: a module moved to another subpackage keeps its allowance.
ALLOWED: dict[tuple[str, str], str] = {
    ("__init__.py", "argparse._SubParsersAction"):
        "the type of ArgumentParser.add_subparsers(); argparse has no public name for it",
    ("daemon.py", "os._exit"): "os._exit is public and documented (exit without cleanup)",
    ("worker.py", "os._exit"): "os._exit is public and documented (exit without cleanup)",
    ("detokenizer.py", "from mlx_lm.tokenizer_utils import _byte_decoder"):
        "mlx-lm's byte-level BPE table; the UTF-8-safe detokenizer decodes with the same one",
    ("streaming.py", "from mlx_lm.tokenizer_utils import _byte_decoder"):
        "mlx-lm's byte-level BPE table; the UTF-8-safe detokenizer decodes with the same one",
    ("detokenizer.py", "tokenizer._detokenizer"):
        "mlx-lm's TokenizerWrapper keeps its detokenizer there; mlxd swaps in its UTF-8-safe one",
    ("prompt_disk.py", "cache_module._BaseCache"):
        "mlx-lm's cache base class: only its subclasses may be rebuilt from a file on disk",
}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_names(tree: ast.Module) -> set[str]:
    """Every name the module defines: module level, in its classes, and assigned on objects."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.alias) and is_private(node.asname or ""):
            names.add(node.asname or "")
    return names


def is_own(value: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"


def reaches(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of each private name the module uses but does not own."""
    tree = ast.parse(source)
    own = defined_names(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [
                (node.lineno, f"from {'.' * node.level}{node.module or ''} import {a.name}")
                for a in node.names
                if is_private(a.name)
            ]
        elif (
            isinstance(node, ast.Attribute)
            and is_private(node.attr)
            and not is_own(node.value)
            and node.attr not in own
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_rule_catches_reach_and_leaves_own_privates() -> None:
    """The checker flags another module's privates (attribute or import) and passes a module's own."""
    reach = """
from mlxd.journal.writer import _take_lock
def release(manager, lease):
    manager._release(lease)
    journal._subscribers.discard(lease)
"""
    assert [e for _, e in reaches(reach)] == [
        "from mlxd.journal.writer import _take_lock", "manager._release", "journal._subscribers",
    ]
    own = """
class Hub:
    def __init__(self):
        self._subs = set()
    def _offer(self, x):
        return x
def feed(hub, x):
    hub._offer(x)
    return super()._whatever, hub._subs
"""
    assert reaches(own) == []


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_reads_another_modules_privates(path: Path) -> None:
    """The module uses no private name it does not define itself (the allowances aside)."""
    where = str(path.relative_to(PACKAGE))
    bad = [
        f"{where}:{line}: {expr}"
        for line, expr in reaches(path.read_text())
        if (path.name, expr) not in ALLOWED
    ]
    assert bad == [], "reach into another module's privates:\n" + "\n".join(bad)


def test_every_allowance_is_still_needed() -> None:
    """Each allowance names a reach that still exists, so the list cannot rot."""
    used = {
        (p.name, expr) for p in modules() for _, expr in reaches(p.read_text())
    }
    assert set(ALLOWED) - used == set()
