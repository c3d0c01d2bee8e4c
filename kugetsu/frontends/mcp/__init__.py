"""`kugetsu mcp`: kugetsu as Model Context Protocol tools for the agents that delegate
(docs/architecture.md §11; docs/mcp.md).

The MCP SDK (and pydantic, which it brings) is an optional extra, imported only when this
command runs: the everyday commands never pay its ~0.5 s. Without it, the command says how
to install it (exit 2). Over stdio, the client's `initialize` is answered before the SDK is
loaded (kugetsu.frontends.mcp.handshake).
"""

from __future__ import annotations

from kugetsu.paths import Home


def run(home: Home, http: str | None = None, allow_remote: bool = False) -> int:
    """Serve over stdio until the client closes it, or over streamable HTTP at `http`."""
    from kugetsu.frontends.mcp import handshake

    if http is None:
        return handshake.stdio(home)
    # Refuse a bad address or a missing token before the SDK costs its import.
    from kugetsu.frontends.mcp.address import parse, token

    address = parse(http, allow_remote)
    secret = token(home)
    server, follow = handshake.build(home)
    import anyio

    from kugetsu.frontends.mcp.http import serve

    anyio.run(serve, server, follow, address, secret)
    return 0
