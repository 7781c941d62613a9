"""The live dashboard at ``/ui`` (``/`` redirects there): static HTML, CSS and JavaScript shipped in the package.

The page is part of the public surface but holds no data of its own: it is fed
only by the public routes (``/admin/status``, ``/admin/events``,
``/admin/history``, ``/admin/plan``, ``/health``), which keep their auth. So
``/ui`` itself needs no key; with keys configured the page asks for one (kept
in the browser tab's ``sessionStorage``) and ``/admin/whoami`` tells it which
scopes that key has, so it shows only what the key allows.

Every response of ``/ui`` carries a strict Content-Security-Policy: scripts,
styles and connections from this origin only, no inline script or style
(the page sets styles through the CSSOM, which such a policy allows), no
frames. Nothing is fetched from a third party, so it works offline.
"""

from __future__ import annotations

from importlib import resources

from quart import Blueprint, Response, g

from mlxd.config.model import SCOPES
from mlxd.errors import NotFound
from mlxd.http.bodies_admin import Whoami
from mlxd.http.context import state

bp = Blueprint("dashboard", __name__)

#: the files of the page, with their media types (nothing else is served from /ui)
FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)



def page_file(name: str) -> bytes:
    """The bytes of one file of the page, from the package."""
    return resources.files("mlxd.http").joinpath("ui", name).read_bytes()


def _serve(name: str) -> Response:
    if name not in FILES:
        raise NotFound(f"no file {name!r} in the dashboard")
    resp = Response(page_file(name), content_type=FILES[name])
    resp.headers["Content-Security-Policy"] = CSP
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "no-referrer"
    resp.headers["Cache-Control"] = "no-cache"
    return resp


@bp.get("/")
async def root() -> Response:
    """A person who opens the daemon's address in a browser lands on the dashboard."""
    resp = Response("", status=302)
    resp.headers["Location"] = "/ui"
    return resp


@bp.get("/ui")
@bp.get("/ui/")
async def dashboard_page() -> Response:
    return _serve("index.html")


@bp.get("/ui/<name>")
async def dashboard_file(name: str) -> Response:
    return _serve(name)


@bp.get("/admin/whoami")
async def whoami() -> Whoami:
    """The key this request presented: its name and scopes (any known key may ask)."""
    st = state()
    key = g.get("mlxd_key")
    return {
        "client": key.name if key is not None else None,
        "scopes": sorted(key.scopes) if key is not None else list(SCOPES),
        "auth_required": st.auth.enabled,
    }
