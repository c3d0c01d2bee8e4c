"""`kugetsu mcp --http ADDR`: what may be listened on, and the token it needs. No SDK here:
a refused address or a missing token is said before the SDK is imported."""

from __future__ import annotations

import os

from kugetsu.config.load import load_config
from kugetsu.config.model import is_loopback, parse_address
from kugetsu.errors import UsageError
from kugetsu.frontends.guard import check_token
from kugetsu.paths import Home

TOKEN_ENV = "KUGETSU_MCP_TOKEN"
SET_TOKEN = "openssl rand -hex 32 | kugetsu config set mcp.token -"


def parse(text: str, allow_remote: bool) -> tuple[str, int]:
    """HOST:PORT ([::1]:PORT for IPv6; port 0 picks a free one). Only a loopback address
    unless `allow_remote`: anyone who reaches the port can run commands as you (a delegated
    task is a command), the token being all that stands in the way."""
    try:
        host, port = parse_address(text, "--http", "127.0.0.1:8765")
    except ValueError as err:
        raise UsageError(str(err)) from None
    if not allow_remote and not is_loopback(host):
        raise UsageError(
            f"--http {text}: refusing to listen on {host}, which is not a loopback address: anyone who can reach it"
            " could delegate commands that run as you. Use 127.0.0.1 (clients on this machine), or add"
            " --allow-remote if you mean it (behind TLS, with a strong mcp.token)")
    return host, port


def token(home: Home) -> str:
    """The bearer token every HTTP request must carry: KUGETSU_MCP_TOKEN, else mcp.token;
    one that is blank or short is refused (a guess would let anyone in)."""
    value = os.environ.get(TOKEN_ENV)
    where = TOKEN_ENV
    if not value:
        value, where = load_config(home).mcp.token, "mcp.token"
    if not value:
        raise UsageError(
            "kugetsu mcp --http needs a bearer token, so that no other local user or web page can use it: set one"
            f" with `{SET_TOKEN}` (or put it in {TOKEN_ENV}), and give clients the header"
            " `Authorization: Bearer <token>`")
    return check_token(value, where, f"set a random one with `{SET_TOKEN}`")
