"""Who may talk to a server: one ASGI middleware in front of everything it serves (the HTTP API
of `serve`, and the app's page, its Gradio API and the HTTP API on the app's port).

    policy = AccessPolicy(bind_host="127.0.0.1", api_key="s3cret", allowed_origins=("https://app.example",))
    app.add_middleware(Guard, policy=policy)      # before any route or mounted app sees a request

A request passes these checks in order; the first it fails answers it with one line, in the
protocol's error shape under `/v1` (`{"error": {"message", "type", "param", "code"}}`) and as
`{"error": "..."}` elsewhere, and nothing behind the guard runs (no generation starts):

1. **Host** (403): the `Host` header names a loopback name or address (`localhost`,
   127.0.0.1, [::1]), the bound address, or a name `--allowed-hosts` gives (`*`: any), with or
   without a port. Bound to every interface (0.0.0.0, ::), any IP address and this machine's
   host name pass too: a page can make a browser send a foreign *name* to a local server (DNS
   rebinding), never a foreign address. A request without `Host` (HTTP/1.0) comes from no browser.
2. **Origin** (403): a browser request may come only from the server's own origin (the scheme,
   host and port it was sent to, either scheme), from a loopback origin on the same port when
   the request came over loopback, or from an origin `--allowed-origins` names (`*`: any,
   `null` must be named). Requests without `Origin` (SDKs, curl) pass. A CORS preflight from an
   allowed origin is answered here (204, `Access-Control-Allow-*`); its responses carry
   `Access-Control-Allow-Origin`. Cookies are never shared across origins.
3. **API key** (401), when there is one, for everything but preflights: `Authorization: Bearer
   KEY`, or the HttpOnly cookie a browser gets by opening any page with `?key=KEY` or by the
   login form that a page opened without the key shows.
4. **JSON bodies at /v1** (415): a POST, PUT or PATCH under `/v1` must say `Content-Type:
   application/json` (a charset may follow). A page's "simple" cross-site request cannot.
5. **Body size** (413): refused up front when `Content-Length` passes the limit, else as soon
   as the bytes read pass it; the rest is never read.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
import json
import re
import socket
from dataclasses import dataclass, field
from functools import cached_property
from urllib.parse import parse_qsl, quote, urlencode

from starlette.datastructures import MutableHeaders
from starlette.requests import ClientDisconnect, HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .openai.schemas import MAX_BODY_BYTES, ApiError

WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}
DEFAULT_PORTS = {"http": 80, "https": 443}
LOGIN_PATH = "/triforce/login"
LOGIN_BODY_BYTES = 4096
BODY_METHODS = {"POST", "PUT", "PATCH"}
_ORIGIN = re.compile(r"^(https?)://(\[[0-9a-f:.]+\]|[a-z0-9.\-_]+)(?::(\d{1,5}))?$")
_HEADER_NAMES = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~,\s-]*$")  # what a preflight may ask to send


def split_list(text: str | None) -> tuple[str, ...]:
    """A comma list from the command line: `"a, b,"` -> ("a", "b")."""
    return tuple(part.strip() for part in (text or "").split(",") if part.strip())


def split_host(value: str) -> tuple[str, int | None]:
    """A Host header's (name, port): `"[::1]:8000"` -> ("[::1]", 8000); lower case, no final dot."""
    value = value.strip().lower()
    name, port = value, None
    if value.startswith("["):  # an IPv6 address, bracketed
        end = value.find("]")
        name, rest = value[: end + 1], value[end + 1:]
        if rest.startswith(":") and rest[1:].isdigit():
            port = int(rest[1:])
    elif value.count(":") == 1:
        name, _, tail = value.partition(":")
        port = int(tail) if tail.isdigit() else None
    return name.rstrip("."), port


def ip_of(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None


def is_loopback(name: str) -> bool:
    """`localhost` or a loopback address (127.0.0.0/8, ::1)."""
    ip = ip_of(name)
    return name == "localhost" or (ip is not None and ip.is_loopback)


def parse_origin(origin: str) -> tuple[str, str, int] | None:
    """`"http://localhost:3000"` -> ("http", "localhost", 3000); None for "null" or anything else."""
    m = _ORIGIN.match(origin.strip().lower().rstrip("/"))
    if m is None:
        return None
    scheme, name, port = m.groups()
    return scheme, name.rstrip("."), int(port) if port else DEFAULT_PORTS[scheme]


def normal_origin(origin: str) -> str:
    """An origin as the policy compares it (lower case, no default port); ValueError if it is none."""
    if origin in ("*", "null"):
        return origin
    parsed = parse_origin(origin)
    if parsed is None:
        raise ValueError(f"{origin!r} is not an origin: write scheme://host[:port], e.g. http://localhost:3000")
    scheme, name, port = parsed
    return f"{scheme}://{name}" + ("" if DEFAULT_PORTS[scheme] == port else f":{port}")


@dataclass(frozen=True)
class AccessPolicy:
    """What a server accepts (see the module's docstring). `max_api_body` limits request bodies
    under `api_prefix`, `max_body` everywhere else (the app: its upload limit and the form around it)."""

    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)
    max_api_body: int = MAX_BODY_BYTES
    max_body: int = MAX_BODY_BYTES
    api_prefix: str = "/v1"
    machine_names: frozenset[str] = field(default_factory=frozenset)  # filled for a wildcard bind

    def __post_init__(self):
        hosts = tuple(h.strip().lower().rstrip(".") for h in self.allowed_hosts if h.strip())
        for h in hosts:
            if h != "*" and not re.fullmatch(r"[a-z0-9.\-_\[\]:]+", h):
                raise ValueError(f"{h!r} is not a host name: write a name or address, optionally with :port")
        object.__setattr__(self, "allowed_hosts", hosts)
        object.__setattr__(self, "allowed_origins", tuple(normal_origin(o) for o in self.allowed_origins))
        object.__setattr__(self, "api_key", self.api_key or None)
        if self.max_api_body <= 0 or self.max_body <= 0:
            raise ValueError("body limits must be positive")
        if self.bind_host.strip().lower() in WILDCARD_HOSTS and not self.machine_names:
            names = {socket.gethostname().lower()}
            object.__setattr__(self, "machine_names", frozenset(names | {f"{n}.local" for n in names}))

    @property
    def wildcard(self) -> bool:
        return self.bind_host.strip().lower() in WILDCARD_HOSTS

    def host_allowed(self, host: str | None) -> bool:
        """Whether a request sent with this `Host` header is served (see check 1)."""
        if host is None or "*" in self.allowed_hosts:
            return True
        name, _ = split_host(host)
        if host.strip().lower() in self.allowed_hosts or name in self.allowed_hosts or is_loopback(name):
            return True
        if name == split_host(self.bind_host)[0] or ip_of(name) is not None and ip_of(name) == ip_of(self.bind_host):
            return True
        return self.wildcard and (ip_of(name) is not None or name in self.machine_names)

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        """Whether a browser page at `origin` may send requests to `host` (see check 2)."""
        if "*" in self.allowed_origins:
            return True
        parsed = parse_origin(origin)
        if parsed is None:
            return origin.strip().lower() == "null" and "null" in self.allowed_origins
        if self.cross_origin_allowed(origin):
            return True
        if host is None:
            return False
        scheme, name, port = parsed
        host_name, host_port = split_host(host)
        same_port = port == (host_port or DEFAULT_PORTS[scheme])
        return same_port and (name == host_name or is_loopback(name) and is_loopback(host_name))

    def cross_origin_allowed(self, origin: str) -> bool:
        """Whether `origin` is one the flags name (it gets CORS headers)."""
        try:
            return "*" in self.allowed_origins or normal_origin(origin) in self.allowed_origins
        except ValueError:
            return False

    @cached_property
    def cookie_token(self) -> str:
        """What the key cookie holds: derived from the key, never the key itself."""
        return hmac.new((self.api_key or "").encode(), b"triforce-studio browser cookie", hashlib.sha256).hexdigest()

    def key_matches(self, given: str) -> bool:
        return self.api_key is not None and hmac.compare_digest(given.encode(), self.api_key.encode())


class Guard:
    """The ASGI middleware that applies an `AccessPolicy` to every HTTP and WebSocket request."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        conn = HTTPConnection(scope)
        refusal = self._refusal(conn)
        if scope["type"] == "websocket":
            if refusal is not None:
                return await send({"type": "websocket.close", "code": 1008, "reason": refusal[1][:120]})
            return await self.app(scope, receive, send)
        if refusal is None:
            return await self._serve(conn, receive, send)
        status, message, code = refusal
        if status == 401 and self._wants_page(conn):  # a person at a browser: the form
            return await self._login_page(conn, send, "" if "authorization" not in conn.headers else message)
        await self._send_error(conn, send, status, message, code)

    # -- the checks --------------------------------------------------------------------------
    def _refusal(self, conn: HTTPConnection) -> tuple[int, str, str] | None:
        """(status, one line, code) of the first check `conn` fails (1-3), else None."""
        host, origin = conn.headers.get("host"), conn.headers.get("origin")
        if not self.policy.host_allowed(host):
            return 403, (f"the Host {host!r} is not this server's name; start it with --allowed-hosts naming it to "
                         "serve it (a guard against DNS rebinding)"), "host_not_allowed"
        if origin is not None and not self.policy.origin_allowed(origin, host):
            return 403, (f"requests from the web page at {origin} are refused; start the server with "
                         "--allowed-origins naming it to let that page call it"), "origin_not_allowed"
        if self._is_preflight(conn) or self.policy.api_key is None or self._has_key(conn):
            return None
        if conn.scope["type"] == "http" and self._logging_in(conn):
            return None  # the form or the link checks the key it brings
        auth = conn.headers.get("authorization")
        return 401, ("missing API key: send 'Authorization: Bearer <key>'" if not auth
                     else "incorrect API key"), "invalid_api_key"

    def _is_preflight(self, conn: HTTPConnection) -> bool:
        return (conn.scope["type"] == "http" and conn.scope["method"] == "OPTIONS" and "origin" in conn.headers
                and "access-control-request-method" in conn.headers)

    def _has_key(self, conn: HTTPConnection) -> bool:
        scheme, _, token = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self.policy.key_matches(token.strip()):
            return True
        cookie = conn.cookies.get(self._cookie_name(conn), "")
        return hmac.compare_digest(cookie.encode(), self.policy.cookie_token.encode())

    def _logging_in(self, conn: HTTPConnection) -> bool:
        method, path = conn.scope["method"], conn.scope["path"]
        if path == LOGIN_PATH and method == "POST":
            return True
        return method == "GET" and "key" in conn.query_params and not self._is_api(conn)

    def _is_api(self, conn: HTTPConnection) -> bool:
        prefix = self.policy.api_prefix
        return conn.scope["path"] == prefix or conn.scope["path"].startswith(prefix + "/")

    # -- serving -----------------------------------------------------------------------------
    async def _serve(self, conn: HTTPConnection, receive: Receive, send: Send) -> None:
        scope, headers = conn.scope, conn.headers
        origin = headers.get("origin")
        cors = origin if origin is not None and self.policy.cross_origin_allowed(origin) else None
        if self._is_preflight(conn):
            return await self._preflight(conn, send, cors)
        if self.policy.api_key is not None and self._logging_in(conn):
            return await self._log_in(conn, receive, send)
        is_api = self._is_api(conn)
        if is_api and scope["method"] in BODY_METHODS:
            ctype = headers.get("content-type")
            if (ctype or "").split(";")[0].strip().lower() != "application/json":
                return await self._send_error(conn, send, 415, "the request body must be JSON: send 'Content-Type: "
                                              f"application/json' (got {ctype or 'none'!r})", "unsupported_media_type")
        limit = self.policy.max_api_body if is_api else self.policy.max_body
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                return await self._send_error(conn, send, 400, f"bad Content-Length {declared!r}", "invalid_request")
            if int(declared) > limit:
                return await self._send_error(conn, send, 413, f"the request body is {int(declared):,} bytes; the "
                                              f"limit is {limit:,}", "request_too_large")
        body = _LimitedBody(receive, send, limit, lambda: self._send_error(
            conn, send, 413, f"the request body is over the limit of {limit:,} bytes", "request_too_large"))
        outgoing = body.send if cors is None else _with_cors(body.send, cors)
        try:
            await self.app(scope, body.receive, outgoing)
        except ClientDisconnect:
            if not body.refused:
                raise

    async def _preflight(self, conn: HTTPConnection, send: Send, cors: str | None) -> None:
        headers = {"Access-Control-Allow-Methods": "GET, POST, OPTIONS", "Access-Control-Max-Age": "600",
                   "Vary": "Origin"}
        if cors is not None:
            headers["Access-Control-Allow-Origin"] = cors
        asked = conn.headers.get("access-control-request-headers", "")
        headers["Access-Control-Allow-Headers"] = asked if _HEADER_NAMES.match(asked) and asked else \
            "Authorization, Content-Type"
        await _respond(send, 204, b"", "text/plain", headers)

    async def _log_in(self, conn: HTTPConnection, receive: Receive, send: Send) -> None:
        """The login form's POST (`key`, `next`) or a page opened with `?key=`: on the right key,
        the cookie and a redirect to the page without the key."""
        if conn.scope["method"] == "POST":
            raw, more = b"", True
            while more and len(raw) <= LOGIN_BODY_BYTES:
                message = await receive()
                raw += message.get("body", b"")
                more = message.get("more_body", False) and message["type"] == "http.request"
            form = dict(parse_qsl(raw[:LOGIN_BODY_BYTES].decode("utf-8", "replace")))
            key, target = form.get("key", ""), form.get("next", "/")
        else:
            query = [(k, v) for k, v in conn.query_params.multi_items() if k != "key"]
            key, target = conn.query_params["key"], conn.scope["path"] + ("?" + urlencode(query) if query else "")
        if not self.policy.key_matches(key):
            return await self._login_page(conn, send, "incorrect API key")
        if not target.startswith("/") or target.startswith("//") or "\\" in target:
            target = "/"  # only this server's own pages
        secure = "; Secure" if conn.scope.get("scheme") == "https" else ""
        cookie = f"{self._cookie_name(conn)}={self.policy.cookie_token}; Path=/; HttpOnly; SameSite=Strict{secure}"
        await _respond(send, 303, b"", "text/plain", {"Location": target, "Set-Cookie": cookie,
                                                     "Cache-Control": "no-store"})

    # -- answers -----------------------------------------------------------------------------
    def _cookie_name(self, conn: HTTPConnection) -> str:
        # Cookies are not kept apart by port: two servers on one machine must not share one.
        server = conn.scope.get("server") or (None, None)
        return f"triforce_key_{server[1] or 0}"

    def _wants_page(self, conn: HTTPConnection) -> bool:
        return (conn.scope["method"] in ("GET", "HEAD") and not self._is_api(conn)
                and "text/html" in conn.headers.get("accept", ""))

    async def _login_page(self, conn: HTTPConnection, send: Send, error: str) -> None:
        target = conn.scope["path"] if conn.scope["path"] != LOGIN_PATH else "/"
        page = (
            "<!doctype html><html><head><meta charset='utf-8'><title>TriForce Studio: API key</title>"
            "<meta name='viewport' content='width=device-width'></head>"
            "<body style='font-family:sans-serif;max-width:32em;margin:4em auto'>"
            "<h1>TriForce Studio</h1><p>This server was started with an API key. Enter it to continue.</p>"
            f"<p id='tf-login-error' style='color:#b00'>{html.escape(error)}</p>"
            f"<form method='post' action='{LOGIN_PATH}'>"
            "<input type='password' name='key' autofocus autocomplete='current-password' aria-label='API key'> "
            f"<input type='hidden' name='next' value='{html.escape(quote(target, safe='/'))}'>"
            "<button type='submit'>Open</button></form></body></html>"
        )
        await _respond(send, 401, page.encode(), "text/html; charset=utf-8", {"Cache-Control": "no-store"})

    async def _send_error(self, conn: HTTPConnection, send: Send, status: int, message: str, code: str) -> None:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
        if self._is_api(conn):
            body = ApiError(status, message, code=code).body()
        else:
            body = {"error": message}
        await _respond(send, status, json.dumps(body).encode(), "application/json", headers)


class _LimitedBody:
    """`receive` that counts a body's bytes: past `limit`, the app is told the client left and
    the client gets `refuse()` (when nothing was sent yet); the app's later messages are dropped."""

    def __init__(self, receive: Receive, send: Send, limit: int, refuse):
        self._receive, self._send, self.limit, self._refuse = receive, send, limit, refuse
        self.read, self.started, self.refused = 0, False, False

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.read += len(message.get("body", b""))
            if self.read > self.limit:
                self.refused = True
                if not self.started:
                    self.started = True
                    await self._refuse()
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if self.refused:
            return  # the refusal went out; what the app says after it is dropped
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


def _with_cors(send: Send, origin: str) -> Send:
    """`send` that marks a response as readable by `origin` (an allowed one), without cookies."""

    async def cors_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = MutableHeaders(scope=message)
            headers["Access-Control-Allow-Origin"] = origin  # replaces one the app may have set
            if "access-control-allow-credentials" in headers:
                del headers["access-control-allow-credentials"]
            headers.add_vary_header("Origin")
        await send(message)

    return cors_send


async def _respond(send: Send, status: int, body: bytes, media_type: str, headers: dict[str, str]) -> None:
    raw = [(b"content-type", media_type.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
