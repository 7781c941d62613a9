"""A real daemon (fake engines) and a real headless Chromium for the dashboard tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import CHROMIUM_ARGS, REQUIRE_ENV, VIEWER_KEY, Site, chromium_path
from tests.support.daemon import DaemonProcess, fake_models_config, write_config


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    path = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None  # type: ignore[assignment]
    if path is None or sync_playwright is None:
        why = "no chromium on PATH" if path is None else "the playwright package is missing"
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set but {why}")
        pytest.skip(f"{why}: install Debian's chromium (apt-get install chromium) to run the dashboard tests")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    p = context.new_page()
    p.set_default_timeout(10_000)
    try:
        yield p
    finally:
        context.close()


def _serve(folder: Path, key: str | None) -> Iterator[Site]:
    raw = fake_models_config({"a": 1.0, "b": 1.0, "c": 1.0}, 2.0, strategy="preempt", load_seconds=0.1)
    env = {}
    if key is not None:
        raw["server"] = {"keys": [
            {"name": "ops", "env": "MLXD_TEST_UI_KEY", "scopes": ["inference", "read", "admin"]},
            {"name": "viewer", "env": "MLXD_TEST_UI_VIEWER", "scopes": ["read"]},
        ]}  # fmt: skip
        env["MLXD_TEST_UI_KEY"] = key
        env["MLXD_TEST_UI_VIEWER"] = VIEWER_KEY
    config = write_config(folder / "models.yaml", raw)
    journal = folder / "j.db"
    with DaemonProcess(config, folder, env=env, args=("--journal", str(journal))) as d:
        yield Site(d.url, journal, key, folder)


@pytest.fixture(scope="module")
def shared_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """One daemon for the module's tests (starting one costs a second or two each)."""
    yield from _serve(tmp_path_factory.mktemp("ui"), None)


@pytest.fixture
def site(shared_site: Site) -> Site:
    """The shared daemon with every model unloaded, as a fresh one would be."""
    shared_site.unload_all()
    return shared_site


@pytest.fixture(scope="module")
def keyed_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    yield from _serve(tmp_path_factory.mktemp("ui-key"), "s3cret-key")


@pytest.fixture(scope="module")
def slow_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """A daemon whose one model takes 2.5 s to load (long enough to watch) and has a KV and a prompt cache."""
    folder = tmp_path_factory.mktemp("ui-slow")
    raw = fake_models_config({"slow": 1.0}, 2.0, load_seconds=2.5)
    raw["models"][0].update(kv_cache_gb=0.5, prompt_cache_gb=0.25)  # memory beyond the weights
    config = write_config(folder / "models.yaml", raw)
    journal = folder / "j.db"
    with DaemonProcess(config, folder, args=("--journal", str(journal))) as d:
        yield Site(d.url, journal, None, folder)
