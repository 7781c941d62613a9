"""Helpers of the dashboard tests: the site under test, the CLI, the browser's path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
#: set by .ci/run: a missing browser is a failure there, not a skip
REQUIRE_ENV = "MLXD_REQUIRE_BROWSER"
#: set to write the README's screenshots into docs/ (the tests always take them)
SCREENSHOTS_ENV = "MLXD_WRITE_SCREENSHOTS"
#: the keyed site's second key: ``read`` only (it may watch, not act)
VIEWER_KEY = "viewer-key"
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def chromium_path() -> str | None:
    return os.environ.get("MLXD_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Site:
    url: str
    journal: Path
    key: str | None
    tmp: Path

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def raw(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10)

    def get(self, path: str) -> Any:
        resp = httpx.get(self.url + path, headers=self._headers(), timeout=10)
        resp.raise_for_status()
        return resp.json()

    def unload_all(self) -> None:
        for name, m in self.get("/admin/status")["models"].items():
            if m["state"] != "unloaded":
                resp = httpx.post(f"{self.url}/admin/models/{name}/unload?preempt=true",
                                  headers=self._headers(), timeout=30)
                resp.raise_for_status()

    def chat(self, model: str) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        resp = httpx.post(self.url + "/v1/chat/completions", json=body, headers=self._headers(), timeout=30)
        resp.raise_for_status()

    def screenshots(self, page: Any) -> None:
        """The busy state at a laptop and a phone size (into docs/ when asked)."""
        folder = DOCS if os.environ.get(SCREENSHOTS_ENV) else self.tmp
        page.set_viewport_size({"width": 1280, "height": 800})
        page.screenshot(path=str(folder / "dashboard.png"), full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})
        page.screenshot(path=str(folder / "dashboard-phone.png"), full_page=True)
        page.set_viewport_size({"width": 1280, "height": 800})


def cli(site: Site, *args: str) -> None:
    """Run the real ``mlxd`` CLI against the site's daemon."""
    extra = ["--api-key", site.key] if site.key else []
    out = subprocess.run(
        [sys.executable, "-m", "mlxd", *args, "--url", site.url, *extra],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr


def wait_until(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


