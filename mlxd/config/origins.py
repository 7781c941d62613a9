"""Which ``Host`` and ``Origin`` a request may carry: the grammar of ``server.allowed_hosts``
and ``server.allowed_origins``, and the rule the HTTP guard applies.

A web page the user visits can make the browser send requests to
``http://127.0.0.1:8080`` (a form, a ``fetch`` with a "simple" body), or make
its own name resolve to 127.0.0.1 and then read the answers (DNS rebinding:
the browser sends the page's name in ``Host``). mlxd without keys trusts
loopback, so it checks both headers (see ``docs/security.md``):

* ``Host``: a loopback name or address (``localhost``, ``127.0.0.0/8``,
  ``::1``; any port), the address mlxd listens on when it is not a wildcard,
  or a name or address listed in ``server.allowed_hosts``. A request without
  ``Host``, or with an empty one (HTTP/1.0), cannot come from a browser and passes.
* ``Origin`` (browsers send it on every cross-origin request and on every
  ``POST``): on a state-changing method it must be the request's own origin
  (the scheme's host and port equal to ``Host``: the dashboard's page) or one
  listed in ``server.allowed_origins``. ``Origin: null`` (a sandboxed frame, a
  file) is never allowed. No ``Origin`` (curl, SDKs, the CLI) passes.

Entries are normalized once, when the config is read: host names lower-case
without a trailing dot, IPv6 addresses without brackets, origins as
``scheme://host[:port]`` without the scheme's default port.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

#: the bind addresses that listen on every interface (their name says nothing to accept)
WILDCARDS = frozenset({"", "0.0.0.0", "::"})
#: methods that never change state (a foreign Origin on them is harmless: no CORS
#: header is ever sent, so the browser does not let the page read the answer)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def split_host(value: str) -> tuple[str, int | None] | None:
    """``(host, port)`` of a ``Host`` header value (``[::1]:8080`` -> ``("::1", 8080)``);
    None if it is not a host with an optional port."""
    value = value.strip().lower()
    port: int | None = None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1:]
        if _address(host) is None:
            return None
        if rest:
            if not rest.startswith(":"):
                return None
            port = _port(rest[1:])
            if port is None:
                return None
        return host, port
    host, sep, tail = value.rpartition(":")
    if not sep:
        host = tail
    elif ":" in host:  # a bare IPv6 address (not valid in a Host header, but unambiguous)
        return (value, None) if _address(value) is not None else None
    else:
        port = _port(tail)
        if port is None:
            return None
    host = host.rstrip(".")
    if not host or any(c.isspace() or c in "/?#@" for c in host):
        return None
    return host, port


def _port(text: str) -> int | None:
    if not (text.isascii() and text.isdigit()) or len(text) > 5 or int(text) > 65535:
        return None
    return int(text)


def is_loopback(host: str) -> bool:
    """``localhost``, or an address of ``127.0.0.0/8`` or ``::1``."""
    if host == "localhost":
        return True
    address = _address(host)
    return address is not None and address.is_loopback


def host_entry(raw: str) -> str:
    """A ``server.allowed_hosts`` entry, normalized; ValueError says what is wrong."""
    parts = split_host(raw)
    if "*" in raw:
        raise ValueError(f"wildcards are not supported: list each name or address (got {raw!r})")
    if "://" in raw or "/" in raw:
        raise ValueError(f"must be a host name or address, not a URL (got {raw!r})")
    if parts is None:
        raise ValueError(f"must be a host name or address (got {raw!r})")
    host, port = parts
    if port is not None:
        raise ValueError(f"give the name without a port: any port is accepted (got {raw!r})")
    return host


def origin_entry(raw: str) -> str:
    """A ``server.allowed_origins`` entry, normalized; ValueError says what is wrong."""
    origin = parse_origin(raw)
    if origin is None:
        raise ValueError(
            f"must be an origin such as 'https://app.example.com' or 'http://localhost:3000' "
            f"(scheme, host and optional port; no path) (got {raw!r})"
        )
    return origin


def parse_origin(value: str) -> str | None:
    """An ``Origin`` value as ``scheme://host[:port]`` (default port left out), or None."""
    try:
        url = urlsplit(value.strip())
        port = url.port
    except ValueError:
        return None
    scheme, host = url.scheme.lower(), (url.hostname or "").rstrip(".")
    if scheme not in _DEFAULT_PORTS or not host or url.path not in ("", "/") or url.query \
            or url.fragment or url.username is not None:
        return None
    shown = f"[{host}]" if ":" in host else host
    if port is None or port == _DEFAULT_PORTS[scheme]:
        return f"{scheme}://{shown}"
    return f"{scheme}://{shown}:{port}"


@dataclass(frozen=True, slots=True)
class BrowserRules:
    """The ``Host`` and ``Origin`` rule of one running server (see the module doc)."""

    #: normalized host names and addresses accepted besides loopback
    hosts: frozenset[str] = frozenset()
    #: normalized origins accepted on state-changing requests besides the request's own
    origins: frozenset[str] = frozenset()

    @classmethod
    def of(cls, bind_host: str, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...]
           ) -> BrowserRules:
        bound = bind_host.strip("[]").lower()
        hosts = set(allowed_hosts) | ({bound} if bound not in WILDCARDS else set())
        return cls(frozenset(hosts), frozenset(allowed_origins))

    def host_allowed(self, host_header: str | None) -> bool:
        if host_header is None or not host_header.strip():  # HTTP/1.0: never a browser's
            return True
        parts = split_host(host_header)
        return parts is not None and (is_loopback(parts[0]) or parts[0] in self.hosts)

    def origin_allowed(self, origin: str, host_header: str | None) -> bool:
        """Whether a state-changing request with this ``Origin`` may go on."""
        normalized = parse_origin(origin)
        if normalized is None:  # "null", or not an origin at all
            return False
        if normalized in self.origins:
            return True
        own = split_host(host_header) if host_header else None
        if own is None:
            return False
        url = urlsplit(normalized)
        default = _DEFAULT_PORTS[url.scheme]
        return url.hostname == own[0] and (url.port or default) == (own[1] or default)
