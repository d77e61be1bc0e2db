"""Who may ask the HTTP front door anything at all, before a route runs (ASGI middleware).

In order, each answered in OpenAI's error JSON:

1. **Host** (DNS rebinding). On a loopback address, a web page whose name the attacker makes
   resolve to 127.0.0.1 would be same-origin to the browser, and could read the answers. So a
   request's ``Host`` must be a loopback name or address (``localhost``, ``127.0.0.1``,
   ``[::1]``; any port: an SSH tunnel may forward another one), or one of
   ``security.allowed_hosts``; else 403. (Another local server's pages, on another port, are
   turned away by their Origin below.) On any
   other address the check applies only when ``security.allowed_hosts`` is set (a non-loopback
   door needs TLS and tokens: router.auth). A request without Host (HTTP/1.0) passes: no
   browser sends one.
2. **Origin** (cross-site requests from a page). A browser names the page's origin on every
   cross-origin POST; one that is not this server's own host (or ``security.allowed_origins``),
   ``null`` included, is refused with 403. No CORS headers are served, so a page elsewhere can
   neither read an answer nor, now, start a generation.
3. **Stopping** (router.drain): every route but ``/health`` answers 503 with ``Retry-After``.
4. **Requests in progress**: at most ``limits.concurrent_rpcs`` at once; beyond, 503 with
   ``Retry-After``. Only requests count, from their headers to their answer's last byte: an idle
   keep-alive connection does not (connections have their own caps: router.http_conn).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from urllib.parse import urlsplit

from router.auth import is_loopback
from router.drain import RETRY_AFTER_S, Gate
from router.openai_api import ApiError

OPEN_PATHS = ("/health",)  # neither counted nor refused while draining: probes must see the state


def split_host(host: str) -> tuple[str, int | None] | None:
    """``name[:port]`` or ``[v6][:port]`` as (lower-case name, port); None when malformed."""
    host = host.strip().lower()
    if host.startswith("["):
        name, sep, rest = host[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port = rest[1:]
    else:
        name, _, port = host.partition(":") if host.count(":") <= 1 else (host, "", "")
    if port and not (port.isdigit() and int(port) < 65536):
        return None
    return (name, int(port)) if port else (name, None)


def host_ok(host: str | None, loopback: bool, allowed: Iterable[str]) -> bool:
    """Whether a request's Host header may reach this server (``loopback``: it listens on a
    loopback address) with ``allowed`` extra names (``name`` or ``name:port``)."""
    allowed = [a.lower() for a in allowed]
    if host is None or not (loopback or allowed):
        return True
    parts = split_host(host)
    if parts is None:
        return False
    name, _ = parts
    return host.strip().lower() in allowed or name in allowed or is_loopback(name)


def origin_ok(origin: str | None, host: str | None, allowed: Iterable[str]) -> bool:
    """Whether a browser's Origin header names this server (same host and port as the request's
    Host) or an allowed origin. No Origin: not a cross-site browser request."""
    if origin is None:
        return True
    origin = origin.strip().lower().rstrip("/")
    if origin in (a.lower().rstrip("/") for a in allowed):
        return True
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and host is not None and parts.netloc == host.strip().lower()


class Guard:
    """ASGI middleware doing the module doc's checks in front of ``app``.

    Args:
        app: the OpenAI API (router.openai_http.build_app).
        gate: the router's drain gate (router.drain.Gate).
        loopback: the server listens on a loopback address.
        security: router.config.SecurityConfig (allowed_hosts, allowed_origins).
        most_active: requests in progress at once (limits.concurrent_rpcs).
    """

    def __init__(self, app, gate: Gate, loopback: bool, security, most_active: int) -> None:
        self.app, self.gate, self.loopback, self.most_active = app, gate, loopback, most_active
        self.allowed_hosts, self.allowed_origins = tuple(security.allowed_hosts), tuple(security.allowed_origins)
        self.active = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in (b"host", b"origin")}
        host, origin = headers.get("host"), headers.get("origin")
        if not host_ok(host, self.loopback, self.allowed_hosts):
            return await answer(send, ApiError(403, f"Host {host[:100]!r} is not this server's: use localhost "
                                                    "or 127.0.0.1 (or add it to security.allowed_hosts)",
                                               code="host_not_allowed"))
        if not origin_ok(origin, host, self.allowed_origins):
            return await answer(send, ApiError(403, f"requests from the web page at {origin[:100]!r} are not "
                                                    "allowed (security.allowed_origins)", code="origin_not_allowed"))
        if scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.gate.draining:
            return await answer(send, unavailable("this server is stopping; retry on another replica"))
        if self.active >= self.most_active:
            return await answer(send, unavailable(f"{self.most_active} requests are in progress "
                                                  "(limits.concurrent_rpcs); retry shortly"))
        self.active += 1
        try:
            with self.gate.call():  # (not draining: checked above, on this same loop turn)
                await self.app(scope, receive, send)
        finally:
            self.active -= 1


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type_="server_error", code="service_unavailable")


async def answer(send, e: ApiError) -> None:
    """Send ``e`` as the whole response (with Retry-After on a 503)."""
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if e.status == 503:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
