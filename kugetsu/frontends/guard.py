"""What every listener of kugetsu's that can act as the user checks before it answers: a
secret, and that the request names this server (Host) and comes from its own page (Origin).
Used by `dashboard --web` (kugetsu/frontends/web.py) and `mcp --http` (kugetsu/frontends/mcp/). Stdlib only,
cheap to import.

Why each check (README "Security"):
- the secret: any local user can connect to a port on 127.0.0.1, so loopback alone keeps
  out only other machines;
- Host: a web page whose own name is made to resolve to 127.0.0.1 (DNS rebinding) sends
  its name, not ours;
- Origin: a browser sends a site's cookies with requests that other pages make, and a
  websocket is not bound by CORS; the Origin is the one header a page cannot forge, and
  every port of 127.0.0.1 is another origin (another local user's server is one).
"""

from __future__ import annotations

import hmac
import secrets
import socket
from urllib.parse import urlsplit

from kugetsu.config.model import is_loopback
from kugetsu.errors import KugetsuError, UsageError

HEADER_TIMEOUT = 5.0  # seconds for a request's head to arrive whole (a real client's takes milliseconds)
MIN_TOKEN = 16  # characters: shorter is guessable by someone who can try it many times a second


def new_token() -> str:
    """A fresh secret: 256 random bits, URL-safe (it travels in a query string once)."""
    return secrets.token_urlsafe(32)


def check_token(value: str, where: str, fix: str) -> str:
    """A secret someone chose: refused (UsageError, exit 2) when blank or short."""
    if not value.strip():
        raise UsageError(f"{where} is blank, which keeps nobody out (a token needs at least {MIN_TOKEN} characters);"
                         f" {fix}")
    if len(value.strip()) < MIN_TOKEN:
        raise UsageError(f"{where} is {len(value.strip())} characters long, too short to keep anyone out"
                         f" (at least {MIN_TOKEN}); {fix}")
    return value.strip()


def same(given: str | bytes | None, secret: str | bytes) -> bool:
    """Constant time: how much of a guess was right must not show in how long the answer took."""
    if given is None:
        return False
    a = given.encode() if isinstance(given, str) else given
    b = secret.encode() if isinstance(secret, str) else secret
    return hmac.compare_digest(a, b)


def split_host(header: str) -> tuple[str, int | None]:
    """`name[:port]` or `[v6][:port]` -> (name, port or None); a malformed one -> ("", None)."""
    header = header.strip().lower()
    if header.startswith("["):
        name, _, rest = header[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        name, _, port = header.partition(":")
    if port and not (port.isascii() and port.isdigit()):
        return "", None
    return name, int(port) if port else None


def host_ok(header: str | None, port: int, remote: bool) -> bool:
    """Does the Host header name this server? On a loopback bind: a loopback name with the
    port we bound. With `--allow-remote` the names the machine goes by cannot be known, so
    any: the secret is what keeps a rebound page out there (the cookie is not its name's)."""
    if remote:
        return True
    name, given = split_host(header or "")
    return is_loopback(name) and (given or 80) == port


def origin_ok(origin: str | None, host: str | None) -> bool:
    """A request a browser makes for a page says which origin the page is from; it must be
    this server's own (same host and port as the Host header). No Origin at all: not a
    browser page (curl, a script), which the secret alone must then let in."""
    if origin is None:
        return True
    parts = urlsplit(origin.strip())
    return parts.scheme in ("http", "https") and bool(parts.netloc) and parts.netloc.lower() == (host or "").lower()


def listen(host: str, port: int, what: str) -> socket.socket:
    """A listening socket, bound before the address is printed: port 0 prints the port it
    got, and a client that reads the address can connect at once. `what`: the option."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise KugetsuError(f"{what} {host}:{port}: cannot listen there: {err.strerror}") from None
    sock.listen(128)
    return sock
