"""The layout keeps its promises: small modules and functions, a light residency core."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mlxd"
TESTS = ROOT / "tests"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
#: where the project's own text lives (bench/ keeps its generated results)
OWN_TEXT = ("mlxd", "tests", "docs", "etc", "migrations", "systemd-like-plists")


def _modules() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *TESTS.rglob("*.py")])


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_and_functions_stay_small(path: Path) -> None:
    """No module of mlxd or of the tests is over 600 lines and no function over 80."""
    text = path.read_text()
    assert text.count("\n") <= MAX_MODULE_LINES, f"{path.name}: {text.count(chr(10))} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.name}: {long}"


def test_every_subpackage_says_what_it_owns() -> None:
    """Each subpackage, nested ones included, opens with a docstring that says what it owns and what it may import."""
    inits = sorted(p for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)
    for init in inits:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc and len(doc) > 200, f"{init.parent.name}: {doc[:80]!r}"
    assert any(p.parent.parent != PACKAGE for p in inits)  # the nested ones (engines/*) too


def test_the_residency_core_imports_no_config_yaml_or_trio() -> None:
    """Importing the residency core loads neither YAML, Trio, SQLite, MLX nor the config."""
    code = (
        "import sys, mlxd.residency.core\n"
        "bad = [m for m in ('yaml', 'trio', 'sqlite3', 'mlx', 'mlxd.config') if m in sys.modules]\n"
        "print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_no_text_points_outside_the_repository() -> None:
    """No comment or doc cites a document that is not in the repository (the facts are in docs/)."""
    outside = ("TECH-NOTES", "/work/shared", "shared/DESIGN.md", "shared/STYLE.md")
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    for folder in OWN_TEXT:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md", ".yaml", ".sql", ".plist", ".service", ".js", ".html", ".css"}]
    this = Path(__file__).resolve()
    hits = [
        f"{p.relative_to(ROOT)}: {word}"
        for p in files
        if p.resolve() != this
        for word in outside
        if word in p.read_text(errors="replace")
    ]
    assert len(files) > 100 and hits == []


def _contracts() -> list[dict[str, Any]]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return list(tomllib.load(f)["tool"]["importlinter"]["contracts"])


def _named(layers: list[str]) -> set[str]:
    return {m.strip() for layer in layers for m in re.split(r"[|:]", layer)}


def test_every_residency_module_and_engine_part_is_in_a_layer() -> None:
    """import-linter checks only the modules a contract names: each module of mlxd.residency
    is in the layers contract, the pure core's in both purity contracts alike, and each part of
    mlxd.engines in the engine layers."""
    contracts = _contracts()
    layered = _named(contracts[0]["layers"])
    residency = {f"mlxd.residency.{p.stem}" for p in (PACKAGE / "residency").glob("*.py")}
    assert residency - {"mlxd.residency.__init__"} - layered == set()
    pure = [c["source_modules"] for c in contracts if c["name"].startswith("The residency core")]
    assert len(pure) == 2 and set(pure[0]) == set(pure[1])
    assert "mlxd.residency.steps" in pure[0]
    (engines,) = [c for c in contracts if c.get("containers") == ["mlxd.engines"]]
    parts = {p.stem if p.suffix else p.name for p in (PACKAGE / "engines").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert parts - _named(engines["layers"]) == set()


#: dotted names in text that are not modules: loggers, files, an API extension's name
NOT_MODULES = {"mlxd.access", "mlxd.worker", "mlxd.responses", "mlxd.yaml", "mlxd.service",
               "mlxd.pub", "mlxd.out.log", "mlxd.err.log", "mlxd.daemon.plist", "mlxd.conf"}


def _resolves(dotted: str) -> bool:
    """``mlxd.a.b.c`` names a module, or a member of one (its first attribute is checked)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return i == len(parts) or hasattr(module, parts[i])
    return False


def test_text_names_only_modules_and_files_that_exist() -> None:
    """Every ``mlxd.x.y`` and ``mlxd/x/y.py`` that code, tests, benches and docs name exists:
    a module moved or a function renamed leaves no docstring or doc pointing at its old place."""
    files = [p for folder in (*OWN_TEXT, "bench") for p in (ROOT / folder).rglob("*")
             if p.suffix in {".py", ".md"} and p.resolve() != Path(__file__).resolve()]
    dotted: dict[str, str] = {}
    paths: dict[str, str] = {}
    for p in files:
        text = p.read_text(errors="replace")
        for m in re.finditer(r"\bmlxd(?:\.[A-Za-z_]\w*)+", text):
            dotted.setdefault(m.group(0), str(p.relative_to(ROOT)))
        for m in re.finditer(r"\bmlxd/[\w/]+\.py\b", text):
            paths.setdefault(m.group(0), str(p.relative_to(ROOT)))
    gone = [f"{where}: {name}" for name, where in dotted.items()
            if name not in NOT_MODULES and not _resolves(name)]
    gone += [f"{where}: {path}" for path, where in paths.items() if not (ROOT / path).exists()]
    assert len(dotted) > 100 and gone == []
