"""The docs say only what exists: every link, file path and route they name is there, and each page says what it covers."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from mlxd.config import builtin_demo_config
from mlxd.http.app import create_app
from mlxd.http.context import AppState

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ROOTS = ("mlxd", "tests", "bench", "docs", "etc", "migrations", "systemd-like-plists", ".ci")
PATH = re.compile(r"`((?:" + "|".join(re.escape(r) for r in ROOTS) + r")/[^`\s]*)`")
ROUTE = re.compile(r"`(GET|POST|DELETE|PUT|PATCH) (/[^`\s]*)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _ids(pages: list[Path]) -> list[str]:
    return [str(p.relative_to(REPO)) for p in pages]


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_file_path_named_exists(page: Path) -> None:
    """A path like `mlxd/http/app.py` or `tests/unit/test_x.py::test_y` in the docs names a real file or folder."""
    missing = []
    for raw in PATH.findall(page.read_text()):
        path = raw.split("::")[0].rstrip(".,;:")
        if "<" in path or "..." in path:
            continue  # a pattern, not a path (docs/<topic>.md)
        found = list(REPO.glob(path)) if "*" in path else [REPO / path]
        if not any(p.exists() for p in found):
            missing.append(raw)
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_link_resolves(page: Path) -> None:
    """A relative link or image in the docs points at a file that exists."""
    broken = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert broken == []


def _served_routes() -> set[tuple[str, str]]:
    # only the URL map is read: the app needs a config and an access-log hook, no manager
    state = SimpleNamespace(config=builtin_demo_config(), request_ended=lambda *_: None)
    app = create_app(cast(AppState, state))
    out = set()
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:\w+:)?\w+>", "{}", rule.rule)
        for method in rule.methods or ():
            out.add((method, path))
    return out


def test_every_route_named_is_served() -> None:
    """`GET /admin/status`-style routes named in any page exist in the app's URL map."""
    served = _served_routes()
    missing = []
    for page in PAGES:
        for method, raw in ROUTE.findall(page.read_text()):
            path = re.sub(r"\{[^}]*\}", "{}", re.split(r"[?\[]", raw)[0]).rstrip(".,;:")
            if "*" in path:
                continue  # a family of routes (`GET /admin/*`)
            if (method, path) not in served:
                missing.append(f"{page.name}: {method} {raw}")
    assert missing == []


@pytest.mark.parametrize("page", PAGES[1:], ids=_ids(PAGES[1:]))
def test_each_page_starts_with_what_it_covers(page: Path) -> None:
    """Every docs page opens with a title and a sentence saying what it covers."""
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# "), lines[0]
    first = next(line for line in lines[1:] if line.strip())
    assert not first.startswith(("#", "```", "|", "-")), first


def test_the_readme_is_short_and_lists_every_docs_page() -> None:
    """The README stays a newcomer's read (at most ~300 lines) and its last table reaches every docs page."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 320
    unlisted = [p.name for p in PAGES[1:] if f"`docs/{p.name}`" not in text]
    assert unlisted == []
