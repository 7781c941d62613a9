"""Hostile web pages in a real Chromium against a daemon without keys (issue 32, finding 3).

A page served from another origin (another port of 127.0.0.1) tries what any
page can: a no-cors ``fetch`` POST with a text body, an auto-submitted form,
and reading ``/admin/history``. A page whose name the browser resolves to
127.0.0.1 (``--host-resolver-rules``, the state a DNS-rebinding attack
reaches) loads ``/ui`` and reads the journal as "same origin". Nothing loads
and nothing is read; the dashboard from its own origin still loads a model.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.browser import CHROMIUM_ARGS, Site, chromium_path, wait_until

pytestmark = pytest.mark.browser

HOSTILE_PAGE = """<!doctype html><html><body>
<form id="f" method="POST" action="{daemon}/admin/models/b/load" target="sink">
  <input name="x" value="1"></form>
<iframe name="sink"></iframe>
<script>
window.results = {{}};
fetch("{daemon}/admin/models/a/load", {{method: "POST", mode: "no-cors",
      headers: {{"Content-Type": "text/plain"}}, body: "{{}}"}})
  .then(() => window.results.post = "sent", e => window.results.post = "error " + e);
fetch("{daemon}/admin/history").then(r => r.text())
  .then(t => window.results.read = t, e => window.results.read = "blocked");
document.getElementById("f").submit();
</script></body></html>"""


@pytest.fixture
def hostile_origin(site: Site) -> Iterator[str]:
    """An HTTP server on another port of 127.0.0.1 (another origin) serving the hostile page."""
    page = HOSTILE_PAGE.format(daemon=site.url).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _states(site: Site) -> dict[str, str]:
    return {name: m["state"] for name, m in site.get("/admin/status")["models"].items()}


def test_a_page_of_another_origin_can_neither_load_nor_read(site: Site, page: Any,
                                                           hostile_origin: str) -> None:
    """The no-cors text POST and the form POST load nothing (the journal has no load), and the page cannot read /admin/history."""
    page.goto(hostile_origin)
    wait_until(lambda: page.evaluate("Object.keys(window.results).length") == 2, timeout=10)
    results = page.evaluate("window.results")
    assert results["read"] == "blocked", "the browser must not let the page read the journal"
    assert _states(site) == {"a": "unloaded", "b": "unloaded", "c": "unloaded"}
    rows = site.get("/admin/history?kind=transitions")
    assert [row for row in rows if row["to_state"] == "loading"] == []


def test_a_rebinding_page_gets_421_and_the_own_origin_still_works(site: Site, browser: Any) -> None:
    """With evil.example resolving to 127.0.0.1, its page gets 421 for /ui and cannot read /admin/history; the dashboard from its own origin loads a model with its button."""
    port = site.url.rsplit(":", 1)[1]
    rebound = browser.browser_type.launch(  # the shared browser has no resolver rules
        executable_path=chromium_path(),
        args=[*CHROMIUM_ARGS, "--host-resolver-rules=MAP evil.example 127.0.0.1"],
    )
    try:
        p = rebound.new_page()
        response = p.goto(f"http://evil.example:{port}/ui")
        assert response is not None and response.status == 421
        assert "host_not_allowed" in p.content()
        read = p.evaluate("fetch('/admin/history').then(r => r.status)")
        assert read == 421
    finally:
        rebound.close()
    own = browser.new_page()
    try:
        own.goto(site.url + "/ui")
        own.wait_for_selector('#models tr[data-model="a"] [data-state="unloaded"]')
        own.click('#models tr[data-model="a"] button[data-action="load"]')
        wait_until(lambda: _states(site)["a"] == "loaded", timeout=10)
    finally:
        own.close()
