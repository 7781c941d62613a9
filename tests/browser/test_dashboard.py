"""The dashboard at /ui, in a real headless Chromium against the real daemon (fake engines).

The browser is Debian's ``chromium`` driven by Playwright (``executable_path``;
Playwright's own browser download is never used). Without a browser these tests
skip, unless ``MLXD_REQUIRE_BROWSER=1`` (set by ``.ci/run``), which makes a
missing browser a failure.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from typing import Any

import httpx
import pytest

from tests.support.browser import VIEWER_KEY, Site, cli, wait_until

pytestmark = pytest.mark.browser


def _row_state(page: Any, model: str) -> str:
    return page.get_attribute(f'#models tr[data-model="{model}"] [data-state]', "data-state")


def _open(site: Site, page: Any) -> None:
    page.goto(site.url + "/ui")
    page.wait_for_selector("#models tbody tr")
    page.wait_for_selector("#stream:text-is('live')")


def test_the_page_shows_each_models_state(site: Site, page: Any) -> None:
    """Every configured model appears with the state /admin/status reports."""
    _open(site, page)
    status = site.get("/admin/status")
    for name, m in status["models"].items():
        assert _row_state(page, name) == m["state"]
    assert "committed of" in page.inner_text("#budget-text")


def test_the_page_shows_the_prompt_cache_disk_tier(site: Site, page: Any) -> None:
    """The prompt cache's disk tier appears under the budget with the bound /admin/status reports."""
    _open(site, page)
    tier = site.get("/admin/status")["prompt_cache_disk"]
    assert tier["enabled"] and tier["max_bytes"] > 0
    text = page.inner_text("#disk-tier")
    assert text.startswith("prompt cache on disk: ") and f"({tier['entries']} entries)" in text


def test_a_load_started_from_the_cli_shows_within_a_second(site: Site, page: Any) -> None:
    """`mlxd load` changes the page within 1 s of the command returning, without a reload."""
    _open(site, page)
    assert _row_state(page, "b") == "unloaded"
    cli(site, "load", "b")
    t0 = time.monotonic()
    page.wait_for_selector('#models tr[data-model="b"] [data-state="loaded"]', timeout=1000)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0
    segs = page.eval_on_selector_all('#budget-bar .seg[data-model="b"]', "els => els.length")
    assert segs >= 1


def test_an_eviction_appears_on_the_timeline_with_its_reason(site: Site, page: Any) -> None:
    """When loading c evicts the idle a, the timeline marks a's lane with `evicted`."""
    cli(site, "load", "a")
    cli(site, "load", "b")
    _open(site, page)
    cli(site, "load", "c")  # the budget holds two: a (least recently used, idle) is evicted
    marker = page.wait_for_selector('.lane[data-model="a"] .marker[data-reason="evicted"]', timeout=3000)
    assert marker is not None
    page.wait_for_selector("#recent li", timeout=3000)
    assert "a: evicted" in page.inner_text("#recent")
    spans = page.eval_on_selector_all(
        '.lane[data-model="c"] rect.span', "els => els.map(e => e.dataset.state)"
    )
    assert spans[-1] == "loaded"
    for model in ("b", "c", "c", "b", "c"):
        site.chat(model)
    page.click('.zoom button[data-range="60"]')
    page.wait_for_selector('.lane[data-model="c"] rect.leases')
    site.screenshots(page)


def test_the_unload_button_unloads_and_the_journal_says_admin(site: Site, page: Any) -> None:
    """Clicking unload on a loaded model unloads it; its journal row has reason `admin`."""
    cli(site, "load", "a")
    _open(site, page)
    page.click('#models tr[data-model="a"] button[data-action="unload"]')
    page.wait_for_selector('#models tr[data-model="a"] [data-state="unloaded"]', timeout=5000)
    rows = site.get("/admin/history?model=a&kind=transitions")
    last = rows[-1]
    assert (last["from_state"], last["to_state"], last["reason"]) == ("unloading", "unloaded", "admin")


def _journaled_seqs(site: Site) -> list[int]:
    with sqlite3.connect(f"file:{site.journal}?mode=ro", uri=True) as db:
        return [r[0] for r in db.execute("SELECT seq FROM events ORDER BY seq")]


def test_a_dropped_event_stream_resumes_without_losing_an_event(site: Site, page: Any) -> None:
    """Events journaled while the page's stream is down arrive after it reconnects, once each."""
    _open(site, page)
    page.evaluate("window.mlxdDashboard.pauseStream()")
    page.wait_for_selector("#stream:text-is('paused')")
    before = max(_journaled_seqs(site), default=0)
    cli(site, "load", "a")
    cli(site, "unload", "a")
    cli(site, "load", "b")
    missed = [s for s in _journaled_seqs(site) if s > before]
    assert len(missed) >= 6  # transitions of three residency changes at least
    assert not set(missed) & set(page.evaluate("window.mlxdDashboard.view.seen"))
    page.evaluate("window.mlxdDashboard.resumeStream()")
    wait_until(lambda: set(missed) <= set(page.evaluate("window.mlxdDashboard.view.seen")), 5)
    seen = page.evaluate("window.mlxdDashboard.view.seen")
    assert len(seen) == len(set(seen)), "an event was delivered twice"
    page.wait_for_selector('#models tr[data-model="b"] [data-state="loaded"]', timeout=2000)
    assert _row_state(page, "a") == "unloaded"


def test_the_page_fits_a_laptop_and_a_phone(site: Site, page: Any) -> None:
    """At 1280x800 and at 390x844 the page has no horizontal scroll and shows every model."""
    for width, height in ((1280, 800), (390, 844)):
        page.set_viewport_size({"width": width, "height": height})
        _open(site, page)
        overflow = page.evaluate("document.scrollingElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"{width}px wide: {overflow}px of horizontal scroll"
        assert page.eval_on_selector_all("#models tbody tr", "els => els.length") == 3


def test_no_csp_violation_and_nothing_from_other_origins(site: Site, page: Any) -> None:
    """Under its strict CSP the page runs without violations and fetches only from its origin."""
    problems: list[str] = []
    origins: set[str] = set()
    page.on("console", lambda m: problems.append(m.text) if "Content Security Policy" in m.text else None)
    page.on("request", lambda r: origins.add(re.sub(r"^(https?://[^/]+).*$", r"\1", r.url)))
    _open(site, page)
    cli(site, "load", "a")
    page.wait_for_selector('#models tr[data-model="a"] [data-state="loaded"]', timeout=3000)
    assert problems == []
    assert origins == {site.url}


def test_the_page_is_small_static_and_needs_no_key(keyed_site: Site) -> None:
    """/ui loads without a key, under 100 KB, with a strict CSP and no inline script or style."""
    total = 0
    for name in ("", "/app.js", "/app.css"):
        resp = keyed_site.raw("/ui" + name)
        assert resp.status_code == 200, name
        assert "script-src 'self'" in resp.headers["content-security-policy"]
        total += len(resp.content)
        if name == "":
            html = resp.text
    assert total < 100_000, f"the page weighs {total} bytes"
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), "an inline <script>"
    assert not re.search(r"\sstyle=|\son[a-z]+=", html), "an inline style or event handler"
    assert keyed_site.raw("/admin/status").status_code == 401


def test_with_a_key_the_page_asks_for_it_then_shows_everything(keyed_site: Site, page: Any) -> None:
    """With auth on, the page asks for a key; the right key shows the models and the buttons."""
    page.goto(keyed_site.url + "/ui")
    page.wait_for_selector("#key-form:not([hidden])")
    page.fill("#key-input", "wrong")
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("#key-error:not([hidden])")
    page.fill("#key-input", keyed_site.key or "")
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("#models tbody tr")
    assert page.eval_on_selector_all('button[data-action="unload"]', "els => els.length") == 3
    assert page.text_content("#who") == "key ops: admin, inference, read"



def test_a_key_without_admin_scope_sees_no_buttons(keyed_site: Site, page: Any) -> None:
    """A read-only key watches the same models but gets no buttons, and the daemon refuses it."""
    page.goto(keyed_site.url + "/ui")
    page.wait_for_selector("#key-form:not([hidden])")
    page.fill("#key-input", VIEWER_KEY)
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("#models tbody tr")
    assert page.eval_on_selector_all("#models tbody tr", "els => els.length") == 3
    assert page.eval_on_selector_all("#models button", "els => els.length") == 0
    assert page.text_content("#who") == "key viewer: read"
    refused = httpx.post(keyed_site.url + "/admin/models/a/load", headers={"x-api-key": VIEWER_KEY}, timeout=10)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "insufficient_scope"


def test_plan_shows_what_loading_a_model_would_do(site: Site, page: Any) -> None:
    """The plan button shows /admin/plan's answer: with a and b resident, c evicts the older a."""
    cli(site, "load", "a")
    cli(site, "load", "b")
    _open(site, page)
    page.click('#models tr[data-model="c"] button[data-action="plan"]')
    page.wait_for_selector("#plan strong:has-text('evict then load')")
    plan = site.get("/admin/plan?model=c")
    assert plan["action"] == "evict_then_load"
    victims = page.eval_on_selector_all("#plan li", "els => els.map(e => e.textContent)")
    assert [v.split(" ")[0] for v in victims] == [v["model"] for v in plan["victims"]] == ["a"]
    assert _row_state(page, "a") == "loaded"  # a plan changes nothing


def test_a_load_shows_its_progress_while_it_runs(slow_site: Site, page: Any) -> None:
    """A first load shows its seconds; once measured, the next load shows a percent and an eta."""
    _open(slow_site, page)
    progress = '#models tr[data-model="slow"] .progress'
    for expected in (r"^\d+\.\ds$", r"^\d+% eta \d+\.\ds$"):
        loader = threading.Thread(target=httpx.post, args=(slow_site.url + "/admin/models/slow/load",), kwargs={"timeout": 30})
        loader.start()
        page.wait_for_selector(progress, timeout=2000)
        text = page.text_content(progress) or ""
        loader.join()
        assert re.match(expected, text), text
        page.wait_for_selector('#models tr[data-model="slow"] [data-state="loaded"]')
        assert page.query_selector(progress) is None
        slow_site.unload_all()
        page.wait_for_selector('#models tr[data-model="slow"] [data-state="unloaded"]')


def test_the_budget_bar_splits_a_model_by_part(slow_site: Site, page: Any) -> None:
    """Weights, KV cache and prompt cache are separate segments, each as wide as its share."""
    _open(slow_site, page)
    httpx.post(slow_site.url + "/admin/models/slow/load", timeout=30).raise_for_status()
    page.wait_for_selector('#models tr[data-model="slow"] [data-state="loaded"]')
    memory = slow_site.get("/admin/status")["models"]["slow"]["memory"]
    segs = page.eval_on_selector_all(
        '#budget-bar .seg[data-model="slow"]',
        "els => els.map(e => [e.dataset.part, parseFloat(e.style.width)])",
    )
    assert [part for part, _ in segs] == ["weights", "kv cache", "prompt cache"]
    budget = slow_site.get("/admin/status")["budget_bytes"]
    for (_, width), key in zip(segs, ("weights", "kv_cache", "prompt_cache"), strict=True):
        assert width == pytest.approx(100 * memory[key] / budget, abs=0.01)
    slow_site.unload_all()


def test_the_timeline_draws_nothing_before_the_daemon_ran(site: Site, page: Any) -> None:
    """On an hour-long timeline of a daemon started minutes ago, no lane has a span before its start."""
    _open(site, page)
    page.wait_for_selector('#timeline .lane[data-model="a"] rect.span')
    xs = page.eval_on_selector_all("#timeline rect.span", "els => els.map(e => +e.getAttribute('x'))")
    width = page.eval_on_selector("#timeline svg", "e => e.viewBox.baseVal.width")
    uptime = site.get("/admin/status")["uptime_s"]
    assert uptime < 1200  # the hour's left half is before this daemon ran
    assert xs and min(xs) > width / 2, (xs, width)


def test_the_address_alone_leads_to_the_dashboard(site: Site, page: Any) -> None:
    """Opening the daemon's bare address shows the dashboard, which says it is connecting until its stream is up."""
    resp = site.raw("/")
    assert resp.status_code == 302 and resp.headers["location"] == "/ui"
    assert ">connecting…</span>" in site.raw("/ui").text
    page.goto(site.url + "/")
    page.wait_for_selector("#stream:text-is('live')")
    assert page.url == site.url + "/ui"
