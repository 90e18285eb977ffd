"""Who may talk to the viewer: Host and Origin checks, the optional token, security headers, rate limits.

    policy = AccessPolicy(allow_origins=["https://viewer.example.com"], allow_hosts=["viewer.example.com"],
                          token="...")  # token: None = no token required
    app.middlewares.append(guard_middleware); app.on_response_prepare.append(add_security_headers)

* Host (every request, against DNS rebinding): allowed when it names the address the connection arrived
  on (the bound interface and port; for a loopback address also `localhost`, `127.0.0.1`, `[::1]`) or an
  `allow_hosts` entry (`name` matches any port, `name:port` that port). Refused: 421 Misdirected Request.
* Origin (every request that has one; browsers send it on every websocket upgrade): allowed when it is
  the page's own origin (same host and port as the already-checked Host) or an `allow_origins` entry.
  Refused: 403. A request without Origin is not from a page (curl, scripts) and passes this check.
* Token (when configured): the websocket offers it as the subprotocol `ddm-token.<token>` (the page reads
  it from its URL fragment `#token=...`), the HTTP API as `Authorization: Bearer <token>`; compared in
  constant time. The page itself and its static files need no token (they hold no data).
* Every response carries CSP, X-Frame-Options, X-Content-Type-Options and Referrer-Policy headers.

* Client key (the per-address socket limit, `client_key`): the peer's address; all loopback addresses
  count as one (`loopback`), an IPv6 address by its /64 (one host's usual share). Behind a reverse proxy
  every peer is the proxy: name it with `trusted_proxies` (`ddm-fleet web --trusted-proxy CIDR`) and the
  client is the right-most X-Forwarded-For hop that is not a trusted proxy (what the nearest trusted proxy
  saw; anything a client writes into the header itself lies to the left of that). Without trusted
  proxies X-Forwarded-For is ignored.

Refusals log one line naming the origin / host (at most `LOG_BURST` lines per 10 s, then a count).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

#: Websocket subprotocol the page always offers (the server selects it); the token rides as a second one.
SUBPROTOCOL = "ddm.v1"
TOKEN_PROTOCOL_PREFIX = "ddm-token."
#: A token: 16-256 URL-safe characters (it travels in a URL fragment and a subprotocol name).
TOKEN_RE = re.compile(r"[A-Za-z0-9._~-]{16,256}")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
LOG_BURST = 20

_DEFAULT_PORT = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def check_token(token: str) -> str:
    """Return `token` stripped, or raise ValueError saying what a token must look like."""
    token = token.strip()
    if not TOKEN_RE.fullmatch(token):
        raise ValueError(
            "a web token must be 16-256 characters of [A-Za-z0-9._~-] "
            f"(got {len(token)} characters); e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    return token


def split_host(value: str) -> tuple[str, int | None] | None:
    """'Example.com:8080' -> ('example.com', 8080); '[::1]' -> ('[::1]', None); None if malformed."""
    value = value.strip().lower()
    if not value or len(value) > 300 or any(c in value for c in "/@ \t\\?#"):
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[: end + 1], value[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text = value.partition(":")
        if not sep:
            port_text = None
    if not host:
        return None
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    return host, int(port_text)


def split_origin(value: str) -> tuple[str, str, int] | None:
    """'https://Viewer.example.com' -> ('https', 'viewer.example.com', 443); None if not http(s)."""
    scheme, sep, rest = value.strip().partition("://")
    scheme = scheme.lower()
    rest = rest[:-1] if rest.endswith("/") else rest
    if not sep or scheme not in ("http", "https") or "/" in rest:
        return None
    hp = split_host(rest)
    if hp is None:
        return None
    host, port = hp
    return scheme, host, port if port is not None else _DEFAULT_PORT[scheme]


def _host_literal(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def served_names(sockname: Any) -> tuple[set[str], int | None]:
    """Host names that address the socket a request arrived on: its IP (all loopback aliases for a
    loopback IP) and its port. `sockname` is the transport's ("ip", port, ...) tuple."""
    if not isinstance(sockname, (tuple, list)) or len(sockname) < 2:
        return set(), None
    ip, port = str(sockname[0]).split("%")[0], int(sockname[1])
    names = {_host_literal(ip)}
    try:
        addr = ipaddress.ip_address(ip)
        if addr.version == 6 and addr.ipv4_mapped is not None:  # a dual-stack socket: ::ffff:10.0.0.5
            addr = addr.ipv4_mapped
            names.add(str(addr))
        if addr.is_loopback:
            names.update(LOOPBACK_NAMES)
    except ValueError:
        pass
    return names, port


@dataclass(frozen=True)
class AccessPolicy:
    """allow_origins: extra page origins ("https://viewer.example.com[:port]").
    allow_hosts: extra Host header values ("name" any port, "name:port"). token: None = not required."""

    allow_origins: tuple[str, ...] = ()
    allow_hosts: tuple[str, ...] = ()
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        origins = []
        for o in self.allow_origins:
            parsed = split_origin(o)
            if parsed is None:
                raise ValueError(
                    f"--allow-origin {o!r} is not an origin: use scheme://host[:port], e.g. https://viewer.example.com"
                )
            origins.append(parsed)
        hosts = []
        for h in self.allow_hosts:
            parsed = split_host(h)
            if parsed is None:
                raise ValueError(f"--allow-host {h!r} is not a host: use name or name:port, e.g. viewer.example.com")
            hosts.append(parsed)
        object.__setattr__(self, "_origins", frozenset(origins))
        object.__setattr__(self, "_hosts", tuple(hosts))
        if self.token is not None:
            object.__setattr__(self, "token", check_token(self.token))

    def host_refusal(self, host_header: str | None, sockname: Any) -> str | None:
        """None if the Host header is allowed, else why not."""
        if host_header is None:
            return "no Host header"
        hp = split_host(host_header)
        if hp is None:
            return f"malformed Host header {host_header[:100]!r}"
        host, port = hp
        names, bound_port = served_names(sockname)
        if host in names and (port or 80) == bound_port:
            return None
        for h, p in self._hosts:
            if h == host and (p is None or p == port):
                return None
        return (
            f"Host {host_header[:100]!r} is not this viewer's address; "
            "a reverse proxy's name needs `ddm-fleet web --allow-host NAME`"
        )

    def origin_refusal(self, origin: str | None, host_header: str) -> str | None:
        """None if the Origin (absent: not a browser page) is allowed for this (already checked) Host."""
        if origin is None:
            return None
        parsed = split_origin(origin)
        if parsed is None:
            return f"Origin {origin[:100]!r} is not allowed"
        if parsed in self._origins:
            return None
        scheme, host, port = parsed
        hp = split_host(host_header)
        if hp is not None and hp[0] == host and (hp[1] or _DEFAULT_PORT[scheme]) == port:
            return None
        return (
            f"Origin {origin[:100]!r} is not allowed: only the viewer's own page "
            "(or `ddm-fleet web --allow-origin ORIGIN`) may use it"
        )

    def token_ok(self, offered: Iterable[str]) -> bool:
        """True when no token is required or one of `offered` equals it (constant-time compare)."""
        if self.token is None:
            return True
        want = self.token.encode()
        ok = False
        for candidate in offered:
            ok |= hmac.compare_digest(candidate.encode(), want)
        return ok


def offered_tokens(request: web.Request) -> list[str]:
    """Token candidates of a request: `ddm-token.<t>` subprotocols and `Authorization: Bearer <t>`."""
    out = []
    for item in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
        item = item.strip()
        if item.startswith(TOKEN_PROTOCOL_PREFIX):
            out.append(item[len(TOKEN_PROTOCOL_PREFIX) :])
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        out.append(value.strip())
    return out[:4]


Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
#: X-Forwarded-For hops read (from the right) before giving up on finding an untrusted one.
MAX_FORWARDED_HOPS = 32


def parse_trusted_proxies(values: Iterable[str]) -> tuple[Network, ...]:
    """'10.0.0.0/8', '127.0.0.1', '::1' -> networks; ValueError naming a bad one."""
    out = []
    for value in values:
        try:
            out.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError:
            raise ValueError(
                f"--trusted-proxy {value!r} is not an address or network: use e.g. 10.0.0.5, 10.0.0.0/8 or ::1"
            ) from None
    return tuple(out)


def parse_address(text: str) -> Address | None:
    """'10.0.0.5', '10.0.0.5:4711', '[2001:db8::1]:443', '2001:db8::1', '::ffff:10.0.0.5' -> the address
    (an IPv4-mapped IPv6 address as IPv4); None if it is none."""
    text = text.strip()
    if text.startswith("["):
        text = text[1 : text.find("]")] if "]" in text else ""
    elif text.count(":") == 1:
        text = text.split(":", 1)[0]
    try:
        addr = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if addr.version == 6 and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def address_key(addr: Address) -> str:
    """What the per-client limits count by: `loopback` for every loopback address (one machine),
    an IPv6 address's /64, else the address."""
    if addr.is_loopback:
        return "loopback"
    if addr.version == 6:
        return str(ipaddress.ip_network(f"{addr}/64", strict=False))
    return str(addr)


def client_key(peer: str | None, forwarded_for: Iterable[str], trusted: tuple[Network, ...]) -> str:
    """The client a request counts against: its peer address, or behind trusted proxies (the peer is one)
    the right-most X-Forwarded-For hop that is not a trusted proxy (`forwarded_for`: every
    X-Forwarded-For header value, in order). All hops trusted: the left-most one. A malformed hop ends
    the walk: the client is the trusted hop that reported it."""
    addr = parse_address(peer) if peer else None
    if addr is None:
        return "?"

    def is_trusted(a: Address) -> bool:
        return any(a in net for net in trusted)

    if not trusted or not is_trusted(addr):
        return address_key(addr)
    hops = [hop for value in forwarded_for for hop in value.split(",") if hop.strip()]
    for hop in reversed(hops[-MAX_FORWARDED_HOPS:]):
        hop_addr = parse_address(hop)
        if hop_addr is None:
            break
        addr = hop_addr
        if not is_trusted(hop_addr):
            break
    return address_key(addr)


def request_client_key(request: web.Request, trusted: tuple[Network, ...]) -> str:
    """`client_key` of an aiohttp request (its peer, its X-Forwarded-For headers)."""
    return client_key(request.remote, request.headers.getall("X-Forwarded-For", []), trusted)


class LogLimiter:
    """At most `burst` log lines per `period` seconds; the rest are counted and reported in the next line."""

    def __init__(self, burst: int = LOG_BURST, period: float = 10.0):
        self.burst, self.period = burst, period
        self._start = time.monotonic()
        self._lines = 0
        self.suppressed = 0

    def warning(self, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._start >= self.period:
            if self.suppressed:
                log.warning("(%d more refusals not logged)", self.suppressed)
            self._start, self._lines, self.suppressed = now, 0, 0
        if self._lines < self.burst:
            self._lines += 1
            log.warning(fmt, *args)
        else:
            self.suppressed += 1


class RateLimit:
    """Token bucket: `allow()` is True while at most `rate` events per second on average (bursts of `burst`)."""

    def __init__(self, rate: float, burst: int):
        if not rate > 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {rate!r}, {burst!r}")
        self.rate, self.burst = float(rate), float(burst)
        self._tokens = self.burst
        self._last = time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


def content_security_policy(host: str | None) -> str:
    """The page's CSP: its own scripts, styles and socket only; never framed."""
    ws = f" ws://{host} wss://{host}" if host else ""
    return (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        f"connect-src 'self'{ws}; frame-ancestors 'none'; base-uri 'none'; form-action 'self'; object-src 'none'"
    )


SECURITY_HEADERS = {
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
}

#: request key holding the Host header once it passed the check (used for CSP connect-src).
CHECKED_HOST = web.RequestKey("ddm_checked_host", str)


POLICY = web.AppKey("ddm_policy", AccessPolicy)
REFUSALS = web.AppKey("ddm_refusals", LogLimiter)


def _refuse(request: web.Request, status: int, reason: str) -> web.Response:
    request.app[REFUSALS].warning(
        "refused %s %s from %s: %s (Origin %r, Host %r)",
        request.method,
        request.path[:100],
        request.remote,
        reason,
        (request.headers.get("Origin") or "")[:100],
        (request.headers.get("Host") or "")[:100],
    )
    return web.Response(status=status, text=f"refused: {reason}\n")


@web.middleware
async def guard_middleware(request: web.Request, handler):
    """Host check, then Origin check, on every request; refusals answer 421 / 403 with the reason."""
    policy = request.app[POLICY]
    host = request.headers.get("Host")
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    why = policy.host_refusal(host, sockname)
    if why is not None:
        return _refuse(request, 421, why)
    request[CHECKED_HOST] = host
    why = policy.origin_refusal(request.headers.get("Origin"), host)
    if why is not None:
        return _refuse(request, 403, why)
    if request.path.startswith("/api/") and not policy.token_ok(offered_tokens(request)):
        return _refuse(request, 401, "this viewer needs its token: send `Authorization: Bearer <token>`")
    return await handler(request)


def refuse_log(request: web.Request, fmt: str, *args: Any) -> None:
    """Log one (rate-limited) refusal line."""
    request.app[REFUSALS].warning(fmt, *args)


async def add_security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: CSP and friends on every response (pages, files, errors, refusals)."""
    response.headers["Content-Security-Policy"] = content_security_policy(request.get(CHECKED_HOST))
    for k, v in SECURITY_HEADERS.items():
        response.headers.setdefault(k, v)
